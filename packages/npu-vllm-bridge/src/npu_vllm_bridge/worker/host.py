"""Host-mode worker and model runner: vLLM's CPU ones with the bridge's graph wiring."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from npu_vllm_bridge.graphs.runner import GraphRunnerMixin

logger = init_logger(f"vllm.{__name__}")

_GEMM_DISPATCH = "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"


class HostModelRunner(GraphRunnerMixin, CPUModelRunner):
    """vLLM's ``CPUModelRunner`` that captures and replays npu-graphs host graphs.

    A host graph is a recording of aten ops. vLLM's CPU linear layers call oneDNN
    or SGL GEMM kernels through opaque C++ ops whose work such a recording cannot
    see, so with graphs on the linear layers use ``torch.nn.functional.linear``.
    """

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        if self.compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
            return super().load_model(*args, **kwargs)
        with mock.patch(_GEMM_DISPATCH, _aten_linear):
            return super().load_model(*args, **kwargs)


def _aten_linear(layer: torch.nn.Module, remove_weight: bool = False) -> None:
    layer.cpu_linear = torch.nn.functional.linear


class HostWorker(CPUWorker):
    """vLLM's ``CPUWorker`` with :class:`HostModelRunner`; captures graphs after warm-up."""

    def init_device(self) -> None:
        super().init_device()
        self.model_runner = HostModelRunner(self.vllm_config, self.device)

    def determine_available_memory(self) -> int:
        """vLLM's CPU estimate of KV-cache memory, less the graphs' profiled memory."""
        if self.model_config.enforce_eager:
            return super().determine_available_memory()
        graphs = self.model_runner.profile_graph_memory()
        available = max(super().determine_available_memory() - graphs, 0)
        logger.info(
            "KV cache gets %.2f GiB after %.2f MiB reserved for graphs",
            available / 2**30,
            graphs / 2**20,
        )
        return available

    def compile_or_warm_up_model(self):
        times = super().compile_or_warm_up_model()
        if not self.model_config.enforce_eager:
            self.model_runner.capture_model()
        return times
