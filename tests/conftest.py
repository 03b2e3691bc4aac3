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
