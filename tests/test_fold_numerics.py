"""dev/fold_numerics.py, the simulation behind the classifier-fold lead in docs/matmul_notes.md: the folded path
(p' = exp(logit - B) stored in bf16, one scale per row, the one-hot folded into one element) must stay at least as
accurate as today's bf16 path for B anywhere within 40 of the row maxima, and its loss must not depend on B
beyond rounding. No GPU."""
import importlib.util

from tests.conftest import ROOT


def test_the_fold_is_no_less_accurate_than_today():
    spec = importlib.util.spec_from_file_location("fold_numerics", ROOT / "dev" / "fold_numerics.py")
    fn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fn)
    got = fn.errors(rows=48, V=6007, Vp=6016, seed=3)
    today = got.pop("today")
    assert len(got) == 4
    for name, errs in got.items():
        assert all(e <= t for e, t in zip(errs, today)), (name, errs, today)
        assert max(errs) < 2e-2, (name, errs)
    losses = [errs[0] for errs in got.values()]
    assert max(losses) - min(losses) < 1e-4
