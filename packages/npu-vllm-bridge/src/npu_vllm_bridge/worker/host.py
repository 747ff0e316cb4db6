"""Host-mode worker and model runner: vLLM's CPU ones with the bridge's graph wiring."""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from npu_vllm_bridge.attention.mla_impl import install_mla_dcp
from npu_vllm_bridge.collectives import record_collectives_whole
from npu_vllm_bridge.graphs.counters import write_counters_where_asked
from npu_vllm_bridge.graphs.runner import GraphRunnerMixin
from npu_vllm_bridge.graphs.ubatch_config import restore_micro_batching
from npu_vllm_bridge.worker.host_moe import moe_layers_through_custom_op

logger = init_logger(f"vllm.{__name__}")

# vLLM's CPU GEMM kernels (vllm._custom_ops.onednn_mm / weight_packed_linear_cpu) and
# its CPU fused-MoE kernel (cpu_fused_moe: the experts of an unquantized MoE layer).
_CPU_GEMM_OPS = ("onednn_mm", "weight_packed_linear", "cpu_fused_moe")


class HostModelRunner(GraphRunnerMixin, CPUModelRunner):
    """vLLM's ``CPUModelRunner`` that captures and replays npu-graphs host graphs.

    A host graph is a recording of aten ops. vLLM's CPU linear layers call oneDNN or
    SGL GEMM kernels, and its MoE layers a fused-experts kernel, through C++ custom ops
    whose work a recording below the op cannot see; they read nothing but their
    arguments (the weight handle is one), so they are recorded whole and host graphs
    run the same kernels as eager steps.
    """

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        if self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
            record_cpu_gemms_whole()
        super().load_model(*args, **kwargs)
        install_mla_dcp(self.vllm_config)
        moe_layers_through_custom_op(self.vllm_config)

    def allocate_pipeline_inputs(self) -> None:
        """The buffers a later pipeline stage copies the previous stage's hidden states
        into. vLLM allocates them in its dummy run, which an eager CPU engine never makes
        (without this its second stage fails its first step)."""
        from vllm.distributed.parallel_state import get_pp_group

        if get_pp_group().is_first_rank or self.intermediate_tensors is not None:
            return
        self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
            batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
        )


def record_cpu_gemms_whole() -> None:
    """Register vLLM's CPU GEMM custom ops (those this build has) as whole host-graph ops."""
    from npu_graphs.backends.host import HostGraphBackend

    packets = [getattr(torch.ops._C, name, None) for name in _CPU_GEMM_OPS]
    HostGraphBackend.record_whole(*[p.default for p in packets if p is not None])


class HostWorker(CPUWorker):
    """vLLM's ``CPUWorker`` with the bridge's runner of the model runner vLLM selected:
    :class:`HostModelRunner` (V1), or ``HostModelRunnerV2`` (``host_v2.py``); captures
    graphs after warm-up. Micro-batch overlap held by the platform is switched back on
    first (``graphs/ubatch_config.py``). Writes its graph counters after every step where
    ``NPU_BRIDGE_COUNTERS_DIR`` asks for them (``graphs/counters.py``)."""

    def init_device(self) -> None:
        restore_micro_batching(self.vllm_config)
        super().init_device()
        self.model_runner = self._bridge_model_runner()
        if self.model_config.enforce_eager:
            return
        from vllm.distributed.parallel_state import get_pcp_group, get_tp_group

        groups = [get_tp_group(), get_pcp_group()]
        record_collectives_whole([group.device_communicator for group in groups])

    def _bridge_model_runner(self) -> Any:
        if not self.use_v2_model_runner:
            return HostModelRunner(self.vllm_config, self.device)
        from vllm.v1.worker.workspace import init_workspace_manager

        from npu_vllm_bridge.worker.host_v2 import HostModelRunnerV2

        init_workspace_manager(self.device)  # V2's capture locks it; CPUWorker makes none
        if self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
            record_cpu_gemms_whole()
        return HostModelRunnerV2(self.vllm_config, self.device)

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
        if not self.use_v2_model_runner:
            self.model_runner.allocate_pipeline_inputs()
        if not self.model_config.enforce_eager:
            self.model_runner.capture_model()
        return times

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        output = super().execute_model(*args, **kwargs)
        write_counters_where_asked(self.parallel_config.data_parallel_rank, self.rank)
        return output
