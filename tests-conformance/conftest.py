"""Fixtures: torch_npu's published API from its wheel, and a stand-in torch_npu."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # helper modules beside the tests

# A vLLM built empty (no vllm._C, as on Ascend hosts) has no CPU platform of its own
# ("Failed to infer device type"): there the bridge's host platform is the CPU platform
# the tests' vLLM configs are built on, unless NPU_BRIDGE_DEVICE says otherwise.
if importlib.util.find_spec("vllm._C") is None:
    os.environ.setdefault("NPU_BRIDGE_DEVICE", "cpu")

from schema_stand_in import StandInTorchNpu
from stand_in_install import installed_stand_in
from torch_npu_schemas import TorchNpuApi, download_wheel, read_wheel

WHEEL_DIR_ENV = "TORCH_NPU_WHEEL_DIR"  # where to keep (or find) the downloaded wheel


@pytest.fixture(scope="session")
def torch_npu_api(request: pytest.FixtureRequest) -> TorchNpuApi:
    """Schemas and Python API of the pinned torch_npu wheel (downloaded once, cached).

    A failed download fails the tests: these checks must really run in CI.
    """
    configured = os.environ.get(WHEEL_DIR_ENV)
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    if configured:
        dest = Path(configured)
    elif cache is not None:
        dest = cache.mkdir("torch-npu-wheel")
    else:
        raise pytest.UsageError(f"pytest's cache is off: set {WHEEL_DIR_ENV} to a wheel folder")
    dest.mkdir(parents=True, exist_ok=True)
    return read_wheel(download_wheel(dest))


@pytest.fixture
def stand_in(torch_npu_api: TorchNpuApi) -> Iterator[StandInTorchNpu]:
    """Stand-in ``torch_npu`` and ``torch.npu`` for one test (see ``stand_in_install``)."""
    with installed_stand_in(torch_npu_api) as module:
        yield module


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "npu_sim: runs vLLM on the simulated NPU (npu_sim.py), minutes on 2 cores"
    )
