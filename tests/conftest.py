"""Shared fixtures. GPU tests carry @pytest.mark.gpu and use the `rt` fixture (one Runtime per session)."""
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repository root (importable through pytest's pythonpath option)


@pytest.fixture(scope="session")
def rt():
    """The CUDA runtime; skips the test if there is no GPU or no PyCUDA."""
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        pytest.skip("PyCUDA not installed")
    from llmc.runtime import Runtime
    from llmc.errors import LLMCError
    try:
        return Runtime()
    except LLMCError as e:
        pytest.skip(str(e))


@pytest.fixture
def rng():
    return np.random.default_rng(1337)


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only every N-th collected test starting at the K-th (0 <= K < N): the GPU "
                          "suite split over device calls (pytest -m gpu --shard 0/2, then --shard 1/2)")


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec is None:
        return
    try:
        k, n = (int(x) for x in spec.split("/"))
        if not 0 <= k < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"--shard {spec}: expected K/N with 0 <= K < N, e.g. --shard 0/2") from None
    keep = [it for i, it in enumerate(items) if i % n == k]
    config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if i % n != k])
    items[:] = keep
