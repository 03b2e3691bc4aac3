"""dev/profile_step.py's bracketing (instrument): every kernel a training step launches lies between the
start and end events of one record, the folded classifier's launches included (they are not in model.k:
until session 44 the profile left them out, ~10% of a bf16 d12 step, and its ops summed short of the
step). Over the CPU tests' fake runtime: the model's builds and launches as on a GPU, no device."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from llmc.backend import CudaBackend
from llmc.config import config_from_name
from llmc.model import GPT2
from llmc.runtime import DevArray, nvcc_path

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dev" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Mark:
    """An event whose record() puts a marker in the fake runtime's launch list."""

    def __init__(self, rt):
        self.rt = rt

    def record(self, stream=None):
        self.rt.launches.append(self)

    def synchronize(self):
        pass


@pytest.mark.skipif(nvcc_path() is None, reason="the fake runtime checks entry points against nvcc's PTX")
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_profile_brackets_every_launch_of_a_step(monkeypatch, precision):
    from fake_runtime import FakeRuntime
    import llmc.ops.gemm_wgmma as gw
    profile = _load("profile_step")
    rt = FakeRuntime(check_ptx=False)
    # no device memory behind the fake runtime's arrays, no driver to encode the TMA's tensor maps
    for name in ("set", "set_async", "fill_bytes", "get_into"):
        monkeypatch.setattr(DevArray, name, lambda self, *a, **k: self)
    monkeypatch.setattr(DevArray, "get", lambda self, *a, **k: np.zeros(self.shape, self.dtype))
    monkeypatch.setattr(gw, "_libcuda", type("NoDriver", (), {"cuTensorMapEncodeTiled": staticmethod(lambda *a: 0)})())
    monkeypatch.setenv("LLMC_CLASSIFIER_FOLD", "1")
    be = CudaBackend({}, quiet=True, rt=rt, precision=precision)
    B, T = 2, 64
    model = GPT2(config_from_name("d12"), be, B, T, side_stream=False)
    model.use_graphs = False
    model.init_params(0)
    assert model.fold is not None, "the folded classifier should run here (engine 5 on sm_90)"
    x = np.zeros((B, T), np.int32)

    def step(i):
        model.zero_grad(); model.forward(x, x, read_loss=False); model.backward(); model.update(3e-4, i + 1)

    step(0)  # (the first step's one-off launches: the fold's prime)
    rt.event = lambda: _Mark(rt)
    records = profile.instrument(model, rt)
    start = len(rt.launches)
    step(1)
    seq = rt.launches[start:]
    pos = {id(m): i for i, m in enumerate(seq) if isinstance(m, _Mark)}
    spans = [(pos[id(s)], pos[id(e)]) for _, _, s, e in records]
    kernels = [i for i, m in enumerate(seq) if not isinstance(m, _Mark)]
    assert kernels, "no launches seen"
    loose = [seq[i].func for i in kernels if not any(a < i < b for a, b in spans)]
    assert not loose, f"launches outside every profiled op: {loose}"
    keys = {k for k, *_ in records}
    assert {"fold/forward", "fold/combine", "fold/fix", "fold/scale"} <= keys, sorted(keys)
