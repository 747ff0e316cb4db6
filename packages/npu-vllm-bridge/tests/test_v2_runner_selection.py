"""Which model runner the bridge's workers build for the runner vLLM selected (host mode's
V1 and V2 runners are exercised in vLLM by tests-integration/; the NPU V2 runner's
graph calls by tests-conformance/test_npu_v2_graphs.py), and the NPU worker's reserve of
graph memory before the KV cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as GPUModelRunnerV1

from npu_vllm_bridge.graphs.v2_runner import GraphManagerHook
from npu_vllm_bridge.host.worker import HostModelRunner, HostWorker
from npu_vllm_bridge.worker.npu import NPUModelRunner, NPUWorker
from npu_vllm_bridge.worker.npu_v2 import NPUModelRunnerV2


def _npu_worker(use_v2_model_runner: bool) -> NPUWorker:
    worker = NPUWorker.__new__(NPUWorker)  # no NPU here: only the runner choice
    worker.use_v2_model_runner = use_v2_model_runner
    return worker


def test_the_npu_worker_builds_the_v2_runner_under_model_runner_v2() -> None:
    runner_class = _npu_worker(True).model_runner_class()
    assert runner_class is NPUModelRunnerV2
    assert issubclass(runner_class, GPUModelRunnerV2)
    assert not issubclass(runner_class, GPUModelRunnerV1)
    # The bridge's hook comes before vLLM's runner: its load_model and
    # initialize_kv_cache run around vLLM's.
    mro = runner_class.__mro__
    assert mro.index(GraphManagerHook) < mro.index(GPUModelRunnerV2)


def test_the_npu_worker_builds_the_v1_runner_otherwise() -> None:
    runner_class = _npu_worker(False).model_runner_class()
    assert runner_class is NPUModelRunner
    assert issubclass(runner_class, GPUModelRunnerV1)


@pytest.mark.parametrize("use_v2", [False, True])
def test_the_npu_runners_refuse_kv_caches_vllm_zeroes_by_block(monkeypatch, use_v2) -> None:
    from npu_vllm_bridge.settings import BridgeSettings
    from npu_vllm_bridge.worker import bridge_runner

    npu_settings = BridgeSettings(attention_provider="ascend", kv_cache_split="planes")
    monkeypatch.setattr(bridge_runner, "current_settings", lambda: npu_settings)
    runner_class = _npu_worker(use_v2).model_runner_class()
    runner = runner_class.__new__(runner_class)

    class ZeroedCache:
        needs_kv_cache_zeroing = True

    with pytest.raises(ValueError, match="zeroes by block"):
        runner.initialize_kv_cache(ZeroedCache())


class _ProfilingRunner:
    """Stands in for any of the bridge's runners: its graph-memory profile, counted."""

    def __init__(self, graph_bytes: int) -> None:
        self.graph_bytes, self.calls = graph_bytes, 0

    def profile_graph_memory(self) -> int:
        self.calls += 1
        return self.graph_bytes


def _host_worker(use_v2_model_runner: bool) -> HostWorker:
    worker = HostWorker.__new__(HostWorker)
    worker.use_v2_model_runner = use_v2_model_runner
    return worker


@pytest.mark.parametrize("use_v2", [False, True])
def test_the_host_worker_builds_the_host_runners(use_v2: bool) -> None:
    from npu_vllm_bridge.host.runner_v2 import HostModelRunnerV2

    expected = HostModelRunnerV2 if use_v2 else HostModelRunner
    assert _host_worker(use_v2).model_runner_class() is expected


@pytest.mark.parametrize("make_worker", [_npu_worker, _host_worker])
@pytest.mark.parametrize(
    ("mode", "eager", "kv_cache_memory_bytes", "expected", "profiled"),
    [
        ("FULL_AND_PIECEWISE", False, None, 9 << 30, True),
        ("FULL_DECODE_ONLY", False, None, 9 << 30, True),
        ("NONE", False, None, 10 << 30, False),
        ("FULL_AND_PIECEWISE", True, None, 10 << 30, False),
        ("FULL_AND_PIECEWISE", False, 10 << 30, 10 << 30, False),  # the user's own size
    ],
)
def test_the_workers_reserve_the_profiled_graph_memory_before_the_kv_cache(
    monkeypatch, make_worker, mode, eager, kv_cache_memory_bytes, expected, profiled
) -> None:
    """vLLM's GPU worker profiles graphs only on CUDA, ROCm and XPU, its CPU worker never;
    the bridge's workers, NPU and host alike, take the runner's profile off the KV
    cache's memory (10 GiB here, 1 GiB of graphs)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    for base in (Worker, CPUWorker):
        monkeypatch.setattr(base, "determine_available_memory", lambda self: 10 << 30)
    worker = make_worker(True)
    worker.model_runner = _ProfilingRunner(1 << 30)
    worker.compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode])
    worker.model_config = SimpleNamespace(enforce_eager=eager)
    worker.cache_config = SimpleNamespace(kv_cache_memory_bytes=kv_cache_memory_bytes)
    assert worker.determine_available_memory() == expected
    assert worker.model_runner.calls == int(profiled)


@pytest.mark.parametrize("use_v2", [False, True])
@pytest.mark.parametrize("make_worker", [_npu_worker, _host_worker])
def test_npu_and_host_runners_share_what_the_bridge_adds(make_worker, use_v2) -> None:
    """Every method the NPU runner adds to vLLM's runner class is the host runner's too:
    host mode (and the simulated NPU on it) runs the NPU's logic, not a copy."""
    from npu_vllm_bridge.worker.bridge_runner import BridgeModelRunner, BridgeModelRunnerV2

    runner_class = make_worker(use_v2).model_runner_class()
    shared = BridgeModelRunnerV2 if use_v2 else BridgeModelRunner
    assert issubclass(runner_class, shared)
    npu_class = _npu_worker(use_v2).model_runner_class()
    assert issubclass(npu_class, shared)
    own = [name for name, value in vars(npu_class).items() if callable(value)]
    assert not own, f"NPU-only runner methods no host run reaches: {own}"


@pytest.mark.parametrize("use_v2", [False, True])
def test_host_runners_refuse_zeroed_caches_on_planes_pages(monkeypatch, use_v2) -> None:
    """The refusal the NPU runners make runs in host mode where pages are planes (the
    simulated NPU's layout), and not on packed pages, which vLLM can zero by block."""
    from npu_vllm_bridge.settings import BridgeSettings
    from npu_vllm_bridge.worker import bridge_runner

    runner_class = _host_worker(use_v2).model_runner_class()
    runner = runner_class.__new__(runner_class)

    class ZeroedCache:
        needs_kv_cache_zeroing = True

    planes = BridgeSettings(kv_cache_split="planes")
    monkeypatch.setattr(bridge_runner, "current_settings", lambda: planes)
    with pytest.raises(ValueError, match="zeroes by block"):
        runner.initialize_kv_cache(ZeroedCache())
