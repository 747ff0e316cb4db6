"""Backends to run the graph tests on, and the shared test module ``npu_graphs_cases``."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """A graph backend by name: host everywhere, cuda on the GPU machine."""
    import torch

    import npu_graphs

    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return npu_graphs.get_backend(request.param)


@pytest.fixture
def device(backend):
    """The torch device whose tensors the backend's graphs capture."""
    import torch

    return torch.device("cuda" if backend.name == "cuda" else "cpu")
