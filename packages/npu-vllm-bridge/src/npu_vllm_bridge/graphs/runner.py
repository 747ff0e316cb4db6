"""Graph wiring of the model runner: wrap at load, capture at start-up.

Mixed into a vLLM ``GPUModelRunner`` subclass (the host one, the NPU one). vLLM's
own runner already dispatches each step (``CudagraphDispatcher``: padded size,
FULL / PIECEWISE / NONE) and sets the forward context; the bridge's wrapper reads
it, updates the attention tasks and replays. What this mixin replaces is what
vLLM hard-codes to CUDA: the FULL wrapper class and the capture loop.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from tqdm.auto import tqdm
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention

from npu_graphs import get_backend
from npu_vllm_bridge.graphs.counters import graph_counters
from npu_vllm_bridge.graphs.wrapper import BridgeGraphWrapper, graph_backend_name

logger = init_logger(__name__)


class GraphRunnerMixin:
    """``load_model`` wraps the model for FULL graphs; ``capture_model`` captures them."""

    vllm_config: Any
    compilation_config: Any
    cudagraph_dispatcher: Any
    model: Any

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        if self.compilation_config.cudagraph_mode.has_full_cudagraphs():
            layers = get_layers_from_vllm_config(self.vllm_config, Attention)
            self.model = BridgeGraphWrapper(
                self.model,
                self.vllm_config,
                CUDAGraphMode.FULL,
                num_attention_layers=len(layers),
            )

    def capture_model(self) -> int:
        """Capture every (mode, batch descriptor) vLLM's dispatcher will replay.

        Largest sizes first (smaller ones reuse their pool). Returns the bytes the
        graphs hold, as the backend accounts them.
        """
        mode = self.compilation_config.cudagraph_mode
        groups = self.cudagraph_dispatcher.get_capture_descs()
        if mode == CUDAGraphMode.NONE or not groups:
            return 0
        backend = get_backend(graph_backend_name())
        before = backend.memory_in_use()
        start = time.perf_counter()
        set_cudagraph_capturing_enabled(True)
        try:
            with torch.inference_mode():
                for runtime_mode, descs in groups:
                    self._capture_group(runtime_mode, descs)
        finally:
            set_cudagraph_capturing_enabled(False)
        held = backend.memory_in_use() - before
        counters = graph_counters()
        counters.capture_bytes += held
        counters.eager_steps = 0  # warm-up runs of the capture are not steps
        logger.info(
            "Captured %d %s graphs (%s) in %.1f s; they hold %.2f MiB",
            sum(len(d) for _, d in groups),
            backend.name,
            mode.name,
            time.perf_counter() - start,
            held / 2**20,
        )
        return held

    def _capture_group(self, runtime_mode: CUDAGraphMode, descs: list) -> None:
        kind = "decode" if descs[0].uniform else "mixed prefill-decode"
        for desc in tqdm(descs, desc=f"Capturing graphs ({kind}, {runtime_mode.name})"):
            self._warmup_and_capture(desc, cudagraph_runtime_mode=runtime_mode)  # type: ignore[attr-defined]
