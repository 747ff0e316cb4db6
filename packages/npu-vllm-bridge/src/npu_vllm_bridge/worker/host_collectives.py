"""Tensor-parallel all-reduce that host graphs record and replay.

vLLM's CPU communicator reduces either through its shared-memory kernel
(``torch.ops._C.shm_allreduce``, a custom op that reads only its arguments) or through
``torch.distributed`` over gloo, whose ``c10d.allreduce_`` hands the work to gloo's
threads where no op recorder can see it, and returns a ``Work`` that must be waited on.
In host mode the first is recorded whole; the second is routed through
``npu_vllm_bridge::host_all_reduce_``, one custom op that reduces in place and waits,
recorded whole. Both are then re-issued by every replay, in the order captured, on every
rank (ranks replay the same graphs step by step, as their eager steps run the same ops).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_GROUPS: dict[int, dist.ProcessGroup] = {}
_LIB = torch.library.Library("npu_vllm_bridge", "FRAGMENT")
_LIB.define("host_all_reduce_(Tensor(a!) tensor, int group) -> ()")


def _host_all_reduce(tensor: torch.Tensor, group: int) -> None:
    dist.all_reduce(tensor, group=_GROUPS[group])


_LIB.impl("host_all_reduce_", _host_all_reduce, "CPU")


class RecordedAllReduce:
    """``torch.distributed`` for a communicator, whose sum all-reduce is one custom op."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_reduce(
        tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> None:
        if op != dist.ReduceOp.SUM or async_op or group is None:
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        _GROUPS[id(group)] = group
        torch.ops.npu_vllm_bridge.host_all_reduce_(tensor, id(group))
        return None


def record_all_reduce_whole(communicators: list[Any]) -> None:
    """Make the all-reduce of vLLM's CPU ``communicators`` replayable by host graphs."""
    from npu_graphs.backends.host import HostGraphBackend

    whole = [torch.ops.npu_vllm_bridge.host_all_reduce_.default]
    shm = getattr(torch.ops._C, "shm_allreduce", None)
    if shm is not None:
        whole.append(shm.default)
    HostGraphBackend.record_whole(*whole)
    for communicator in communicators:
        if getattr(communicator, "dist_module", None) is dist:
            communicator.dist_module = RecordedAllReduce()
