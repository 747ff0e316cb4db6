"""The NPU platform's device communicator: vLLM's base one, plus what DP MoE and DBO need.

vLLM's ``DeviceCommunicatorBase`` runs all-reduce, all-gather, reduce-scatter, gather,
send / recv and broadcast over the group's ``torch.distributed`` process group, which on
the NPU is HCCL's (``NPUPlatform.dist_backend``). Data-parallel MoE also needs
``all_gatherv`` / ``reduce_scatterv`` and vLLM's ``allgather_reducescatter`` all-to-all
manager behind the EP group's ``dispatch`` / ``combine``; micro-batch overlap (DBO)
needs each of them to hand the turn to the other micro-batch. Those come from
:class:`~npu_vllm_bridge.worker.variable_collectives.VariableSizeCollectives`, shared
with host mode's communicator; its two primitives run here as the equal-sized tensor
collectives ``torch.distributed.all_gather_into_tensor`` and ``reduce_scatter_tensor``,
which torch_npu's HCCL process group serves (as it serves vLLM's base class) and so does
gloo, over which the unit tests run it. The reduce-scatter pads every rank's part of the
input to the longest, so each rank receives one equal part and keeps its own rows.

torch_npu 2.14 also has ``torch_npu.distributed.all_gather_into_tensor_uneven`` and
``reduce_scatter_tensor_uneven`` (HCCL only, no padding); they are not used: the padded
form runs on any backend torch.distributed has, and DP MoE's parts differ little.
Written against vLLM 0.32's communicator and torch.distributed; it has not run on HCCL.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)

from npu_vllm_bridge.worker.variable_collectives import VariableSizeCollectives


class NPUCommunicator(VariableSizeCollectives, DeviceCommunicatorBase):
    """``DeviceCommunicatorBase`` plus ``all_gatherv``, ``reduce_scatterv`` and the
    all-to-all manager of data-parallel MoE, over the group's process group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_all2all_manager()

    def _all_gather_equal(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        dist.all_gather_into_tensor(output, input_, group=self.device_group)

    def _reduce_scatter_rows(self, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        longest, tail = max(sizes), rows.shape[1:]
        padded = rows.new_zeros((self.world_size, longest, *tail))
        start = 0
        for rank, count in enumerate(sizes):
            padded[rank, :count] = rows[start : start + count]
            start += count
        mine = rows.new_empty((longest, *tail))
        dist.reduce_scatter_tensor(mine, padded.view(-1, *tail), group=self.device_group)
        return mine[: sizes[self.rank_in_group]]
