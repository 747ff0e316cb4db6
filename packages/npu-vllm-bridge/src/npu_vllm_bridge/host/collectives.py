"""vLLM's CPU communicators through the bridge's collective custom ops, which host
graphs record whole (``npu_vllm_bridge/collectives.py`` defines the ops)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from npu_vllm_bridge.collectives import all_gather_, all_reduce_
from npu_vllm_bridge.vllm_seam import (
    CPU_COMMUNICATOR_DIST_MODULE,
    compiled_op,
    get_attribute,
    set_attribute,
)


class RecordedCollectives:
    """``torch.distributed`` for a communicator, whose sum all-reduce and all-gather
    into a tensor are one custom op each."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_reduce(
        tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> None:
        if op != dist.ReduceOp.SUM or async_op or group is None:
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        all_reduce_(tensor, group)
        return None

    @staticmethod
    def all_gather_into_tensor(
        output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> None:
        if async_op or group is None:
            return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
        all_gather_(output, input, group)
        return None


def record_collectives_whole(communicators: list[Any]) -> None:
    """Make the all-reduce and all-gather of vLLM's CPU ``communicators`` (its tensor-
    and prefill-context-parallel groups) and the bridge's own collectives replayable by
    host graphs."""
    from npu_graphs.backends.host import HostGraphBackend

    ops = torch.ops.npu_vllm_bridge
    whole = [
        ops.host_all_reduce_.default,
        ops.host_all_gather_.default,
        ops.host_all_to_all_.default,
    ]
    for name in ("shm_allreduce", "shm_all_gather"):
        shm = compiled_op(name)
        if shm is not None:
            whole.append(shm.default)
    HostGraphBackend.record_whole(*whole)
    for communicator in communicators:
        if get_attribute(communicator, CPU_COMMUNICATOR_DIST_MODULE, None) is dist:
            set_attribute(communicator, CPU_COMMUNICATOR_DIST_MODULE, RecordedCollectives())
