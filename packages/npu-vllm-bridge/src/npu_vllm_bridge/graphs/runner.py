"""Graph wiring of the model runner: wrap at load, profile and capture at start-up.

Mixed into a vLLM ``GPUModelRunner`` subclass (the host one, the NPU one). vLLM's
own runner already dispatches each step (``CudagraphDispatcher``: padded size,
FULL / PIECEWISE / NONE; with DBO, the split into micro-batches) and sets the forward
context; the bridge's wrapper reads it, updates the attention tasks and replays. What
this mixin replaces is what vLLM hard-codes to CUDA: the FULL wrapper class and the
micro-batch wrapper class (``UBatchWrapper``), the capture loop and the graph memory
profile that is subtracted before the KV cache is sized.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.compilation.counter import compilation_counter
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.worker.ubatch_utils import check_ubatch_thresholds

from npu_graphs import GraphBackend, capture_all, get_backend
from npu_vllm_bridge.attention.tasks import count_attention_tasks
from npu_vllm_bridge.graphs.counters import GraphCounters, RunnerCounters
from npu_vllm_bridge.graphs.memory_estimate import estimate_own_bytes
from npu_vllm_bridge.graphs.ubatch_wrapper import (
    BridgeUBatchWrapper,
    vllm_ubatch_wrapper_bypassed,
)
from npu_vllm_bridge.graphs.wrapper import (
    BridgeGraphWrapper,
    graph_backend_name,
    live_wrappers,
    wrappers_of,
)
from npu_vllm_bridge.settings import current_settings
from npu_vllm_bridge.vllm_seam import (
    cleanup_profiling_kv_cache,
    init_minimal_kv_cache_for_profiling,
    set_cudagraphs_captured_count,
    warmup_and_capture,
)

logger = init_logger(f"vllm.{__name__}")


class GraphRunnerMixin(RunnerCounters):
    """``load_model`` wraps the model for FULL graphs; ``capture_model`` captures them;
    ``profile_graph_memory`` estimates their memory before the KV cache exists;
    ``graph_counters()`` sums what its graph wrappers counted."""

    vllm_config: Any
    compilation_config: Any
    parallel_config: Any
    cudagraph_dispatcher: Any
    model: Any

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        # vLLM's GPU runner would wrap the model in its CUDA UBatchWrapper itself.
        with vllm_ubatch_wrapper_bypassed():
            super().load_model(*args, **kwargs)  # type: ignore[misc]
        full = self.compilation_config.cudagraph_mode.has_full_cudagraphs()
        if self.parallel_config.use_ubatching:
            # Where vLLM's GPU runner puts UBatchWrapper (no drafter: refused with DBO).
            self.model = BridgeUBatchWrapper(
                self.model,
                self.vllm_config,
                full_graphs=full,
                num_attention_layers=count_attention_tasks(self.vllm_config, self.model),
            )
        elif full:
            self.model = BridgeGraphWrapper(
                self.model,
                self.vllm_config,
                CUDAGraphMode.FULL,
                num_attention_layers=count_attention_tasks(self.vllm_config, self.model),
            )
        # A drafter's forwards run as vLLM's V1 proposer dispatches them: PIECEWISE or
        # eager (docs/drafter-graphs.md says why the bridge adds no FULL graphs there).

    def graph_component_counters(self) -> list[GraphCounters]:
        """The counters of this engine's graph wrappers: the FULL one or the
        micro-batch one (and its inner FULL one), the PIECEWISE pieces, the drafter's."""
        return [wrapper.counters for wrapper in wrappers_of(self.vllm_config)]

    def capture_model(self) -> int:
        """Capture every (mode, batch descriptor) vLLM's dispatcher will replay,
        largest first, with a progress bar; returns the bytes the graphs hold. With
        ``capture_on_first_use`` none is captured here: the wrapper captures each key
        at its first step."""
        groups = self.cudagraph_dispatcher.get_capture_descs()
        if self.compilation_config.cudagraph_mode == CUDAGraphMode.NONE or not groups:
            return 0
        backend = get_backend(graph_backend_name())
        held = seconds = 0.0
        num_graphs = sum(len(descs) for _, descs in groups)
        lazy = current_settings().capture_on_first_use
        if lazy:
            logger.info(
                "The model's %d %s graph keys are captured at their first step "
                "(capture_on_first_use)",
                num_graphs,
                self.compilation_config.cudagraph_mode.name,
            )
            num_graphs = 0
        set_cudagraph_capturing_enabled(True)
        try:
            with torch.inference_mode():
                for runtime_mode, descs in [] if lazy else groups:
                    report = self._capture_group(backend, runtime_mode, descs)
                    held += report.memory_bytes
                    seconds += report.seconds
        finally:
            set_cudagraph_capturing_enabled(False)
        own, pool = backend.memory_breakdown()
        if num_graphs:
            logger.info(
                "Captured %d %s graphs (%s) in %.1f s: they hold %.2f MiB (%.2f MiB of their "
                "own, %.2f MiB of shared pool)",
                num_graphs,
                backend.name,
                self.compilation_config.cudagraph_mode.name,
                seconds,
                held / 2**20,
                own / 2**20,
                pool / 2**20,
            )
        self.runner_counters.capture_bytes += int(held)
        self.runner_counters.capture_seconds += seconds
        self.start_serving()  # the capture's warm-up forwards are not steps
        return int(held)

    def _capture_group(self, backend: GraphBackend, runtime_mode: CUDAGraphMode, descs: list):
        kind = "decode" if descs[0].uniform else "mixed prefill-decode"

        def capture_one(desc: Any) -> None:
            warmup_and_capture(
                self,
                desc,
                cudagraph_runtime_mode=runtime_mode,
                allow_microbatching=self._split_at_capture(runtime_mode, desc),
            )

        return capture_all(
            descs,
            capture_one,
            backend=backend,
            desc=f"Capturing {backend.name} graphs ({kind}, {runtime_mode.name})",
        )

    def _split_at_capture(self, runtime_mode: CUDAGraphMode, desc: Any) -> bool:
        """Whether ``desc`` is captured split into micro-batches, as vLLM's GPU runner
        decides: FULL uniform-decode sizes at or above the decode threshold (the size's
        steps split then; capture-on-first-use captures whatever the step is)."""
        parallel = self.parallel_config
        return bool(
            parallel.use_ubatching
            and runtime_mode == CUDAGraphMode.FULL
            and desc.uniform
            and check_ubatch_thresholds(parallel, desc.num_tokens, uniform_decode=True)
        )

    def profile_graph_memory(self) -> int:
        """Estimate the memory of all graphs before the KV cache is sized.

        On a minimal KV cache, capture the largest and the smallest graph of each mode
        into the shared pool. The pool (the largest replay's intermediates, shared by
        every graph) counts once; what each graph keeps for itself (its outputs) is fit
        as ``a + b * num_tokens`` and summed over every size to capture. The profiling
        graphs are dropped after.
        """
        if not self.compilation_config.cudagraph_mode.has_full_cudagraphs():
            return 0
        with set_current_vllm_config(self.vllm_config):
            init_minimal_kv_cache_for_profiling(self)
        backend = get_backend(graph_backend_name())
        saved_captures = compilation_counter.num_cudagraph_captured
        own_total = 0
        _, pool_before = backend.memory_breakdown()
        set_cudagraph_capturing_enabled(True)
        try:
            with torch.inference_mode():
                groups = self.cudagraph_dispatcher.get_capture_descs()
                for runtime_mode, descs in groups:
                    own_total += self._estimate_group(backend, runtime_mode, descs)
            _, pool_after = backend.memory_breakdown()
        finally:
            set_cudagraph_capturing_enabled(False)
            for wrapper in live_wrappers():
                wrapper.clear_graphs()
            for key_set in self.cudagraph_dispatcher.cudagraph_keys.values():
                key_set.clear()
            self.cudagraph_dispatcher.keys_initialized = False
            cleanup_profiling_kv_cache(self)
            for counters in self.graph_component_counters():
                counters.captured = counters.split_captured = 0
            set_cudagraphs_captured_count(saved_captures)
        total = own_total + max(pool_after - pool_before, 0)
        self.runner_counters.estimated_bytes = total
        logger.info(
            "Estimated graph memory: %.2f MiB (counted before the KV cache: %.2f MiB of the "
            "graphs' own, %.2f MiB of shared pool)",
            total / 2**20,
            own_total / 2**20,
            (total - own_total) / 2**20,
        )
        return total

    def _estimate_group(
        self, backend: GraphBackend, runtime_mode: CUDAGraphMode, descs: list
    ) -> int:
        """Sum over ``descs`` of each graph's own bytes, fit on the largest and smallest."""
        return estimate_own_bytes(
            backend,
            descs,
            lambda desc: warmup_and_capture(
                self,
                desc,
                cudagraph_runtime_mode=runtime_mode,
                allow_microbatching=self._split_at_capture(runtime_mode, desc),
            ),
        )
