"""What the bridge's model runners add to vLLM's, on the NPU and in host mode alike.

The NPU runners (``npu.py``, ``npu_v2.py``) and the host runners (``host/worker.py``,
``host/runner_v2.py``) mix these in before vLLM's runner class, so that what the NPU runs beyond
vLLM's own runner also runs in host mode, and with the conformance stand-ins, in a
simulated NPU:

* :class:`BridgeModelRunner` (V1): the graph wiring (``graphs/runner.py``), the bridge's
  MLA decode-context-parallel manager, the refusal of KV caches vLLM zeroes by block on
  ``planes`` pages, and ``profile_cudagraph_memory`` as the bridge's graph estimate;
* :class:`BridgeModelRunnerV2` (Model Runner V2): the graph manager hook
  (``graphs/v2_runner.py``), the same MLA manager and refusal, ``capture_model`` with the
  bridge's counters and the graph backend's own memory accounting, and
  ``profile_graph_memory``, V2's estimate with the profiling graphs dropped.

Each runner keeps only what differs by device: vLLM's CPU kernels recorded whole in host
graphs, the PyTorch versions of V2's Triton kernels, a CPU warm-up.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.compilation.monitor import set_cudagraph_capturing_enabled

from npu_graphs import get_backend
from npu_vllm_bridge.attention.kv_cache import refuse_kv_cache_zeroing
from npu_vllm_bridge.attention.mla_impl import install_mla_dcp
from npu_vllm_bridge.graphs.runner import GraphRunnerMixin
from npu_vllm_bridge.graphs.v2_draft_graphs import drafter_graph_bytes
from npu_vllm_bridge.graphs.v2_runner import GraphManagerHook
from npu_vllm_bridge.graphs.wrapper import graph_backend_name, live_wrappers
from npu_vllm_bridge.settings import current_settings


def refuse_zeroed_planes(kv_cache_config: Any) -> None:
    """:func:`refuse_kv_cache_zeroing` where the platform lays pages out as ``planes``
    (vLLM zeroes blocks by id in its packed layout, which ``packed`` pages keep)."""
    if current_settings().kv_cache_split == "planes":
        refuse_kv_cache_zeroing(kv_cache_config)


class BridgeModelRunner(GraphRunnerMixin):
    """Mixin before a V1 ``GPUModelRunner`` subclass (vLLM's GPU or CPU runner)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        install_mla_dcp(self.vllm_config)

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        refuse_zeroed_planes(kv_cache_config)
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)  # type: ignore[misc]

    def profile_cudagraph_memory(self) -> int:
        """vLLM's name for the graphs' memory profile: the bridge's estimate."""
        return self.profile_graph_memory()


class BridgeModelRunnerV2(GraphManagerHook):
    """Mixin before a V2 ``GPUModelRunner`` subclass (vLLM's GPU or CPU runner)."""

    vllm_config: Any
    speculator: Any

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        install_mla_dcp(self.vllm_config)

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        refuse_zeroed_planes(kv_cache_config)
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)

    def capture_model(self, *, profile_only: bool = False) -> int:
        """vLLM's V2 capture; returns the bytes the graphs took by the graph backend's
        own accounting (vLLM measures device memory), or under memory profiling the
        manager's estimate for all of them. Graphs captured to profile memory are not
        counted in the runner's graph counters (vLLM drops them)."""
        backend = get_backend(graph_backend_name())
        captured = {id(c): (c.captured, c.draft_captured) for c in self.graph_component_counters()}
        before, start = backend.memory_in_use(), time.perf_counter()
        set_cudagraph_capturing_enabled(True)
        try:
            super().capture_model(profile_only=profile_only)  # type: ignore[misc]
        finally:
            set_cudagraph_capturing_enabled(False)
        held = backend.memory_in_use() - before
        if profile_only:
            for counters in self.graph_component_counters():
                counters.captured, counters.draft_captured = captured.get(id(counters), (0, 0))
            manager = self.cudagraph_manager
            if not hasattr(manager, "profiled_bytes"):
                return held
            # The target's graphs estimated from samples, the drafter's all captured.
            return manager.profiled_bytes + drafter_graph_bytes(self.speculator)
        self.runner_counters.capture_bytes += held
        self.runner_counters.capture_seconds += time.perf_counter() - start
        self.start_serving()  # warm-up forwards are not steps
        return held

    def profile_graph_memory(self) -> int:
        """vLLM's V2 estimate of the graphs' memory before the KV cache is sized (the
        name the bridge's workers call on either runner)."""
        estimate = self.profile_cudagraph_memory()  # type: ignore[attr-defined]
        for wrapper in live_wrappers():  # vLLM drops its profiling graphs; so do the pieces
            wrapper.clear_graphs()
        self.runner_counters.estimated_bytes = estimate
        return estimate
