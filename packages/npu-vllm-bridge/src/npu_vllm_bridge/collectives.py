"""Collectives between host-mode ranks that host graphs record and replay.

vLLM's CPU communicator reduces either through its shared-memory kernel
(``torch.ops._C.shm_allreduce``, a custom op that reads only its arguments) or through
``torch.distributed`` over gloo, whose ``c10d.allreduce_`` hands the work to gloo's
threads where no op recorder can see it, and returns a ``Work`` that must be waited on.
In host mode the first is recorded whole; the second is routed through
``npu_vllm_bridge::host_all_reduce_``, one custom op that reduces in place and waits,
recorded whole. Its all-gather (prefill context parallelism gathers every rank's latent
rows in each MLA layer) goes the same two ways: ``shm_all_gather`` recorded whole, or
``npu_vllm_bridge::host_all_gather_``. Both are then re-issued by every replay, in the order captured, on every
rank (ranks replay the same graphs step by step, as their eager steps run the same ops).
Host mode routes vLLM's CPU communicators through them (``host/collectives.py``).

Decode context parallelism exchanges tensors between the ranks of vLLM's DCP group in
every attention layer (``attention/context_parallel.py``), and data-parallel MoE
gathers and reduce-scatters every DP rank's tokens (``host/communicator.py``):
``host_all_gather_`` and ``host_all_to_all_``, likewise one custom op each that writes
its output in place and waits, recorded whole by host graphs.

Each op names its process group by ``group_name``, resolved in torch's registry of
process groups when the op runs (as torch's functional collectives do), never by an
object or a per-process id: a graph Dynamo records holds a name that is valid in every
process that made the same groups. Each has a fake implementation that checks shapes
and dtypes and looks nothing up, so that Dynamo, which runs what it traces on fake
tensors when vLLM compiles the model (its default), can trace a model that reaches them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

_LIB = torch.library.Library("npu_vllm_bridge", "FRAGMENT")
_LIB.define("host_all_reduce_(Tensor(a!) tensor, str group) -> ()")
_LIB.define("host_all_gather_(Tensor(a!) out, Tensor input, str group) -> ()")
_LIB.define("host_all_to_all_(Tensor(a!) out, Tensor input, str group) -> ()")


def _host_all_reduce(tensor: torch.Tensor, group: str) -> None:
    dist.all_reduce(tensor, group=_resolve_process_group(group))


def _all_gather(out: torch.Tensor, input: torch.Tensor, group: str) -> None:
    # torch 2.13 renamed all_gather_into_tensor; older releases have only that name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, input, group=_resolve_process_group(group))


def _all_to_all(out: torch.Tensor, input: torch.Tensor, group: str) -> None:
    dist.all_to_all_single(out, input, group=_resolve_process_group(group))


_LIB.impl("host_all_reduce_", _host_all_reduce, "CPU")
_LIB.impl("host_all_gather_", _all_gather, "CompositeExplicitAutograd")
_LIB.impl("host_all_to_all_", _all_to_all, "CompositeExplicitAutograd")


def _same_rows(what: str, out: torch.Tensor, input: torch.Tensor) -> None:
    """``ValueError`` unless ``out`` and ``input`` agree in dtype and trailing shape."""
    if out.dtype != input.dtype or out.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"{what}: out must have input's dtype and shape past dim 0, got out "
            f"{out.dtype} {tuple(out.shape)} and input {input.dtype} {tuple(input.shape)}"
        )


def _fake_all_reduce(tensor: torch.Tensor, group: str) -> None:
    return None


def _fake_all_gather(out: torch.Tensor, input: torch.Tensor, group: str) -> None:
    _same_rows("host_all_gather_", out, input)
    rows = input.shape[0]
    if out.shape[0] % rows if rows else out.shape[0]:
        raise ValueError(
            f"host_all_gather_: out's {out.shape[0]} rows must be a multiple of input's "
            f"{rows} (one block per rank)"
        )


def _fake_all_to_all(out: torch.Tensor, input: torch.Tensor, group: str) -> None:
    _same_rows("host_all_to_all_", out, input)
    if out.shape[0] != input.shape[0]:
        raise ValueError(
            f"host_all_to_all_: out must have input's {input.shape[0]} rows, got {out.shape[0]}"
        )


torch.library.register_fake("npu_vllm_bridge::host_all_reduce_", _fake_all_reduce, lib=_LIB)
torch.library.register_fake("npu_vllm_bridge::host_all_gather_", _fake_all_gather, lib=_LIB)
torch.library.register_fake("npu_vllm_bridge::host_all_to_all_", _fake_all_to_all, lib=_LIB)


def group_handle(group: dist.ProcessGroup) -> str:
    """The name a collective op takes for ``group`` (ops take no process groups)."""
    return group.group_name


def all_gather_(out: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out[r * n : (r + 1) * n] = input`` of rank ``r`` (``n = input.shape[0]``)."""
    torch.ops.npu_vllm_bridge.host_all_gather_(out, input, group_handle(group))


def all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``tensor`` over the ranks of ``group``, in place."""
    torch.ops.npu_vllm_bridge.host_all_reduce_(tensor, group_handle(group))


def all_to_all_(out: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Rank ``r`` sends ``input``'s ``j``-th slice of dim 0 to rank ``j`` and receives
    rank ``j``'s ``r``-th slice in ``out``'s ``j``-th (equal slices)."""
    torch.ops.npu_vllm_bridge.host_all_to_all_(out, input, group_handle(group))
