"""dev/fold_numerics.py, the simulation of the classifier folded into the lm head (docs/matmul_notes.md) as built:
the folded path (p' = exp(logit - B) stored in bf16, one scale per row, the one-hot folded into one element, the
loss from the stored p' of the target, dinp rounded before and after its row scale) must stay at least as
accurate as the unfolded bf16 path for B anywhere within 40 of the row maxima, and its loss must depend on B
only through the rounding of p'_target to bf16. No GPU."""
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
    assert max(losses) - min(losses) < 5e-4  # (seen: 1.2e-4; the bf16 rounding of p'_target moves with B)
