"""Host-mode worker and model runner: vLLM's CPU ones with the bridge's graph wiring."""

from __future__ import annotations

from typing import Any

from vllm.config import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from npu_vllm_bridge.graphs.ubatch_config import restore_micro_batching
from npu_vllm_bridge.host.collectives import record_collectives_whole
from npu_vllm_bridge.host.compiled_ops import avoid_missing_packed_gemm
from npu_vllm_bridge.host.moe import moe_layers_through_custom_op
from npu_vllm_bridge.settings import PREFIX
from npu_vllm_bridge.vllm_seam import compiled_op
from npu_vllm_bridge.worker.bridge_runner import BridgeModelRunner
from npu_vllm_bridge.worker.bridge_worker import BridgeWorkerMixin

logger = init_logger(f"vllm.{__name__}")

# vLLM's CPU GEMM kernels (vllm._custom_ops.onednn_mm / weight_packed_linear_cpu), its
# CPU fused-MoE kernel (cpu_fused_moe: the experts of an unquantized MoE layer) and its
# CPU rotary embedding (in place on the query and key, with custom ops on).
_CPU_KERNEL_OPS = ("onednn_mm", "weight_packed_linear", "cpu_fused_moe", "rotary_embedding")


class HostModelRunner(BridgeModelRunner, CPUModelRunner):
    """vLLM's ``CPUModelRunner`` that captures and replays npu-graphs host graphs, with
    what the bridge's runners add on the NPU too (``bridge_runner.py``).

    A host graph is a recording of aten ops. vLLM's CPU linear layers call oneDNN or
    SGL GEMM kernels, its MoE layers a fused-experts kernel and its rotary embedding a
    rotation kernel, through C++ custom ops whose work a recording below the op cannot
    see; they read nothing but their arguments (the weight handle is one), so they are
    recorded whole and host graphs run the same kernels as eager steps.
    """

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        if self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
            record_cpu_kernels_whole()
        super().load_model(*args, **kwargs)
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


def record_cpu_kernels_whole() -> None:
    """Register vLLM's CPU kernel custom ops (those this build has) as whole host-graph ops."""
    from npu_graphs.backends.host import HostGraphBackend

    packets = [compiled_op(name) for name in _CPU_KERNEL_OPS]
    HostGraphBackend.record_whole(*[p.default for p in packets if p is not None])


class HostWorker(BridgeWorkerMixin, CPUWorker):
    """vLLM's ``CPUWorker`` with what the bridge's workers add on the NPU too
    (``bridge_worker.py``: the runner of the model runner vLLM selected,
    :class:`HostModelRunner` or ``HostModelRunnerV2`` (``runner_v2.py``), the graph-memory
    reserve before the KV cache, the counters); captures graphs after warm-up.
    Micro-batch overlap held by the platform is switched back on first
    (``graphs/ubatch_config.py``)."""

    def init_device(self) -> None:
        restore_micro_batching(self.vllm_config)
        if avoid_missing_packed_gemm():
            logger.info_once(
                f"{PREFIX} host mode: vLLM's CPU linear layers run torch's linear on their "
                "unpacked weights (this vLLM build has no packed-weight GEMM)"
            )
        super().init_device()
        self.model_runner = self._bridge_model_runner()
        if self.model_config.enforce_eager:
            return
        from vllm.distributed.parallel_state import get_pcp_group, get_tp_group

        groups = [get_tp_group(), get_pcp_group()]
        record_collectives_whole([group.device_communicator for group in groups])

    def runner_classes(self) -> tuple[type, type]:
        from npu_vllm_bridge.host.runner_v2 import HostModelRunnerV2

        return HostModelRunner, HostModelRunnerV2

    def _bridge_model_runner(self) -> Any:
        if self.use_v2_model_runner:
            from vllm.v1.worker.workspace import init_workspace_manager

            init_workspace_manager(self.device)  # V2's capture locks it; CPUWorker makes none
            if self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
                record_cpu_kernels_whole()
        return self.model_runner_class()(self.vllm_config, self.device)

    def compile_or_warm_up_model(self):
        times = super().compile_or_warm_up_model()
        if not self.use_v2_model_runner:
            self.model_runner.allocate_pipeline_inputs()
        if not self.model_config.enforce_eager:
            self.model_runner.capture_model()
        return times
