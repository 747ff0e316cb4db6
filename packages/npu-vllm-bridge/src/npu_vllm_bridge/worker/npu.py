"""NPU worker and model runner: vLLM's GPU ones with torch.npu in place of torch.cuda.

The worker builds the runner of the model runner vLLM selected: V1's here, V2's in
``npu_v2.py``.

Written against vLLM 0.32's ``Worker`` / ``GPUModelRunner`` and torch_npu's published
API; it has not run on NPU hardware.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory

from npu_vllm_bridge.attention.kv_cache import refuse_kv_cache_zeroing
from npu_vllm_bridge.attention.mla_impl import install_mla_dcp
from npu_vllm_bridge.graphs.counters import write_counters_where_asked
from npu_vllm_bridge.graphs.runner import GraphRunnerMixin
from npu_vllm_bridge.graphs.ubatch_config import restore_micro_batching

logger = init_logger(f"vllm.{__name__}")

# torch.cuda names vLLM's GPU runner and worker call, and their torch.npu twins.
_CUDA_TO_NPU = (
    "Stream",
    "Event",
    "current_stream",
    "stream",
    "synchronize",
    "set_device",
    "current_device",
    "device_count",
    "empty_cache",
    "mem_get_info",
    "get_device_properties",
    "memory_stats",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "graph_pool_handle",
)


def route_cuda_to_npu() -> None:
    """Point the ``torch.cuda`` functions vLLM's GPU code calls at ``torch.npu``.

    The worker process of the NPU platform has no CUDA device; this makes the
    inherited code (streams, events, memory queries) act on the NPU.
    """
    for name in _CUDA_TO_NPU:
        if hasattr(torch.npu, name):
            setattr(torch.cuda, name, getattr(torch.npu, name))


class NPUModelRunner(GraphRunnerMixin, GPUModelRunner):
    """vLLM's ``GPUModelRunner`` with npu-graphs capture; its graph-memory profile is
    the bridge's estimate, which the NPU worker takes off the KV cache's memory."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        install_mla_dcp(self.vllm_config)

    def profile_cudagraph_memory(self) -> int:
        return self.profile_graph_memory()

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        refuse_kv_cache_zeroing(kv_cache_config)
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)


class NPUWorker(Worker):
    """vLLM's GPU ``Worker`` set up on ``npu:<local_rank>`` with HCCL; writes its graph
    counters after every step where ``NPU_BRIDGE_COUNTERS_DIR`` asks for them."""

    def init_device(self) -> None:
        route_cuda_to_npu()
        restore_micro_batching(self.vllm_config)  # held by the platform (DBO)
        self.device = torch.device(f"npu:{self.local_rank}")
        torch.npu.set_device(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        gc.collect()
        torch.npu.empty_cache()
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = request_memory(self.init_snapshot, self.cache_config, 0)
        self._init_workspace_and_model_runner()

    def determine_available_memory(self) -> int:
        """vLLM's profile of the memory left for the KV cache, less the graphs' memory
        as the model runner profiles it (``profile_cudagraph_memory``: V1's through the
        bridge's capture estimate, V2's by its graph manager). vLLM's GPU worker profiles
        graphs only on CUDA, ROCm and XPU; an NPU's graphs take device memory too. A
        ``kv_cache_memory_bytes`` the user set is kept as given."""
        available = super().determine_available_memory()
        graphs_on = self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
        if (
            not graphs_on
            or self.model_config.enforce_eager
            or self.cache_config.kv_cache_memory_bytes
        ):
            return available
        graphs = self.model_runner.profile_cudagraph_memory()
        logger.info(
            "KV cache gets %.2f GiB after %.2f MiB reserved for graphs",
            max(available - graphs, 0) / 2**30,
            graphs / 2**20,
        )
        return max(available - graphs, 0)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        output = super().execute_model(*args, **kwargs)
        write_counters_where_asked(self.parallel_config.data_parallel_rank, self.rank)
        return output

    def _make_model_runner(self) -> Any:
        return self.model_runner_class()(self.vllm_config, self.device)

    def model_runner_class(self) -> type:
        """The bridge's NPU runner of the model runner vLLM selected: :class:`NPUModelRunner`
        (V1), or ``NPUModelRunnerV2`` (``npu_v2.py``) under Model Runner V2."""
        if not self.use_v2_model_runner:
            return NPUModelRunner
        from npu_vllm_bridge.worker.npu_v2 import NPUModelRunnerV2

        return NPUModelRunnerV2
