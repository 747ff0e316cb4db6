"""NPU worker and model runner: vLLM's GPU ones with torch.npu in place of torch.cuda.

The worker builds the runner of the model runner vLLM selected: V1's here, V2's in
``npu_v2.py``. What they add to vLLM's classes is shared with host mode
(``bridge_worker.py``, ``bridge_runner.py``), where it runs on a CPU and under the
conformance stand-ins as a simulated NPU; what stays here needs an NPU: the device
set-up and ``route_cuda_to_npu``.

Written against vLLM 0.32's ``Worker`` / ``GPUModelRunner`` and torch_npu's published
API; it has not run on NPU hardware.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory

from npu_vllm_bridge.graphs.ubatch_config import restore_micro_batching
from npu_vllm_bridge.vllm_seam import init_workspace_and_model_runner
from npu_vllm_bridge.worker.bridge_runner import BridgeModelRunner
from npu_vllm_bridge.worker.bridge_worker import BridgeWorkerMixin

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


class NPUModelRunner(BridgeModelRunner, GPUModelRunner):
    """vLLM's ``GPUModelRunner`` with what the bridge's runners add (``bridge_runner.py``:
    npu-graphs capture, the graph-memory estimate the worker reserves, the MLA DCP
    manager, the refusal of KV caches vLLM zeroes by block)."""


class NPUWorker(BridgeWorkerMixin, Worker):
    """vLLM's GPU ``Worker`` set up on ``npu:<local_rank>`` with HCCL, with what the
    bridge's workers add (``bridge_worker.py``: its runners, the graph-memory reserve
    before the KV cache, the counters). Only the device set-up is the NPU's own."""

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
        init_workspace_and_model_runner(self)

    def _make_model_runner(self) -> Any:
        return self.model_runner_class()(self.vllm_config, self.device)

    def runner_classes(self) -> tuple[type, type]:
        """:class:`NPUModelRunner` (V1) and ``NPUModelRunnerV2`` (``npu_v2.py``)."""
        from npu_vllm_bridge.worker.npu_v2 import NPUModelRunnerV2

        return NPUModelRunner, NPUModelRunnerV2
