"""Host mode on vLLM's Model Runner V2: its CPU runner with npu-graphs graphs.

The graph manager is the bridge's
(:class:`~npu_vllm_bridge.graphs.v2_graphs.BridgeModelGraphManager`), installed where
vLLM builds its own and handed each step's attention metadata by the hook the NPU's V2
runner shares (``graphs/v2_runner.py``).
"""

from __future__ import annotations

import time
from typing import Any

from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CompilationMode
from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2

from npu_graphs import get_backend
from npu_vllm_bridge.graphs.counters import graph_counters
from npu_vllm_bridge.graphs.v2_draft_graphs import drafter_graph_bytes
from npu_vllm_bridge.graphs.v2_runner import GraphManagerHook
from npu_vllm_bridge.graphs.wrapper import graph_backend_name, live_wrappers
from npu_vllm_bridge.worker.host_moe import moe_layers_through_custom_op
from npu_vllm_bridge.worker.host_v2_kernels import register_pointer_tensors


class HostModelRunnerV2(GraphManagerHook, CPUModelRunnerV2):
    """vLLM's V2 ``CPUModelRunner`` whose graphs are npu-graphs host graphs."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        moe_layers_through_custom_op(self.vllm_config)

    def warming_up_model(self) -> None:
        """A warm-up forward only with something to compile, as vLLM's V1 CPU runner
        (host mode compiles only for PIECEWISE graphs)."""
        if self.compilation_config.mode != CompilationMode.NONE:
            super().warming_up_model()

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's, building the bridge's graph manager; the block tables' data
        pointers are registered for the PyTorch block-table kernels."""
        super().initialize_kv_cache(*args, **kwargs)
        tables = self.block_tables
        register_pointer_tensors([table.gpu for table in tables.block_tables])
        register_pointer_tensors(tables.input_block_tables)
        pcp_tables = getattr(self.pcp_manager, "_local_block_tables", None)
        if pcp_tables is not None:  # prefill context parallel: each rank's local rows
            register_pointer_tensors(pcp_tables)

    def capture_model(self, *, profile_only: bool = False) -> int:
        """vLLM's V2 capture; returns the bytes the graphs took by the graph backend's
        own accounting (vLLM measures device memory), or under memory profiling the
        manager's estimate for all of them. Graphs captured to profile memory are not
        counted in the bridge's counters (vLLM drops them)."""
        backend = get_backend(graph_backend_name())
        counters = graph_counters()
        captured, draft_captured = counters.captured, counters.draft_captured
        before, start = backend.memory_in_use(), time.perf_counter()
        set_cudagraph_capturing_enabled(True)
        try:
            super().capture_model(profile_only=profile_only)
        finally:
            set_cudagraph_capturing_enabled(False)
        held = backend.memory_in_use() - before
        if profile_only:
            counters.captured, counters.draft_captured = captured, draft_captured
            manager = self.cudagraph_manager
            if not hasattr(manager, "profiled_bytes"):
                return held
            # The target's graphs estimated from samples, the drafter's all captured.
            return manager.profiled_bytes + drafter_graph_bytes(self.speculator)
        counters.capture_bytes += held
        counters.capture_seconds += time.perf_counter() - start
        # Warm-up forwards are not steps.
        counters.eager_steps = counters.off_grid_steps = counters.draft_other_forwards = 0
        counters.serving = True
        return held

    def profile_graph_memory(self) -> int:
        """vLLM's V2 estimate of the graphs' memory before the KV cache is sized (the
        name the host worker calls on either runner)."""
        estimate = self.profile_cudagraph_memory()
        for wrapper in live_wrappers():  # vLLM drops its profiling graphs; so do the pieces
            wrapper.clear_graphs()
        graph_counters().estimated_bytes = estimate
        return estimate
