"""What the bridge's workers add to vLLM's, on the NPU and in host mode alike.

:class:`BridgeWorkerMixin` goes before vLLM's worker class in the NPU worker (``npu.py``,
over vLLM's GPU ``Worker``) and the host worker (``host.py``, over its ``CPUWorker``), so
that host mode, and with the conformance stand-ins a simulated NPU, runs it:

* the model runner of the runner vLLM selected (V1 or Model Runner V2), the worker's own;
* the graphs' memory, profiled by the runner (``profile_graph_memory``), reserved before
  the KV cache is sized: vLLM's GPU worker profiles graphs only on CUDA, ROCm and XPU,
  and its CPU worker never; an NPU's graphs take device memory too. A
  ``kv_cache_memory_bytes`` the user set is kept as given, as vLLM keeps it;
* its runner's graph and micro-batch counters (``model_runner.graph_counters()``),
  written after every step where ``NPU_BRIDGE_COUNTERS_DIR`` asks for them
  (``graphs/counters.py``).
"""

from __future__ import annotations

from typing import Any

from vllm.config import CUDAGraphMode
from vllm.logger import init_logger

from npu_vllm_bridge.graphs.counters import write_counters_where_asked

logger = init_logger(f"vllm.{__name__}")


class BridgeWorkerMixin:
    """Mixin before a vLLM worker class; subclasses name their two runner classes."""

    vllm_config: Any
    model_config: Any
    cache_config: Any
    compilation_config: Any
    parallel_config: Any
    model_runner: Any
    device: Any
    rank: int
    use_v2_model_runner: bool

    def runner_classes(self) -> tuple[type, type]:
        """The worker's ``(V1 runner, Model Runner V2 runner)`` classes."""
        raise NotImplementedError

    def model_runner_class(self) -> type:
        """The bridge's runner of the model runner vLLM selected."""
        v1, v2 = self.runner_classes()
        return v2 if self.use_v2_model_runner else v1

    def graph_memory_reserve(self) -> int:
        """Bytes the graphs will take, by the runner's profile; 0 without graphs or with
        a KV cache size the user gave."""
        graphs_on = self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
        if (
            not graphs_on
            or self.model_config.enforce_eager
            or self.cache_config.kv_cache_memory_bytes
        ):
            return 0
        return self.model_runner.profile_graph_memory()

    def determine_available_memory(self) -> int:
        """vLLM's estimate of the memory left for the KV cache, less the graphs'."""
        available = super().determine_available_memory()  # type: ignore[misc]
        graphs = self.graph_memory_reserve()
        if not graphs:
            return available
        logger.info(
            "KV cache gets %.2f GiB after %.2f MiB reserved for graphs",
            max(available - graphs, 0) / 2**30,
            graphs / 2**20,
        )
        return max(available - graphs, 0)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        output = super().execute_model(*args, **kwargs)  # type: ignore[misc]
        write_counters_where_asked(
            self.model_runner.graph_counters, self.parallel_config.data_parallel_rank, self.rank
        )
        return output
