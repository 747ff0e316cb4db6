"""The variable-size collectives of data-parallel MoE, shared by the bridge's communicators.

vLLM's data-parallel MoE layers gather every DP rank's tokens before the experts
(``all_gatherv``) and hand each rank its own rows of the summed expert output back
(``reduce_scatterv``), with a token count per rank, through its ``allgather_reducescatter``
all-to-all manager (``AgRsAll2AllManager``), which the EP group's communicator builds and
to which its ``dispatch`` / ``combine`` go. vLLM's ``DeviceCommunicatorBase`` has neither
collective nor the manager; :class:`VariableSizeCollectives`, mixed in before a vLLM
communicator class, brings them over two primitives of equal-sized parts that each
device's communicator gives: the gather pads every rank's rows to the longest and keeps
each rank's own; the reduce-scatter hands back this rank's rows of the sum.

Under micro-batch overlap (DBO) both are a micro-batch's MoE dispatch and combine: each
runs as a collective of its micro-batch (``micro_batch_collective``), which then hands
the turn to the other micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch

from npu_vllm_bridge.graphs.ubatch_wrapper import micro_batch_collective

ALL2ALL_BACKEND = "allgather_reducescatter"


class VariableSizeCollectives:
    """Mixin before a vLLM ``DeviceCommunicatorBase`` subclass.

    Subclasses give ``_all_gather_equal`` and ``_reduce_scatter_rows``."""

    world_size: int
    rank_in_group: int
    use_all2all: bool
    all2all_backend: Any
    all2all_manager: Any
    cpu_group: Any

    def _all_gather_equal(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        """Every rank's contiguous ``input_`` ``[rows, ...]`` into ``output``
        ``[world_size * rows, ...]``, rank after rank."""
        raise NotImplementedError

    def _reduce_scatter_rows(self, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """This rank's ``sizes[rank]`` rows of the sum over ranks of the contiguous
        ``rows`` ``[sum(sizes), ...]``."""
        raise NotImplementedError

    def init_all2all_manager(self) -> None:
        """vLLM's ``AgRsAll2AllManager`` where the group runs MoE all-to-all
        (``use_all2all``, the EP group of a DP MoE model); ``ValueError`` for a backend
        the bridge does not run."""
        if not self.use_all2all:
            return
        if self.all2all_backend != ALL2ALL_BACKEND:
            raise ValueError(
                f"the bridge runs data-parallel MoE with all2all_backend={ALL2ALL_BACKEND!r} "
                f"(vLLM's all-gather / reduce-scatter manager), got {self.all2all_backend!r}"
            )
        from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

        self.all2all_manager = AgRsAll2AllManager(self.cpu_group)

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Concatenate every rank's ``input_`` along ``dim`` (rank ``r`` brings
        ``sizes[r]`` rows there; equal when ``sizes`` is None). A list gathers each."""
        with micro_batch_collective():
            if isinstance(input_, list):
                return [self._all_gatherv(tensor, dim, sizes) for tensor in input_]
            return self._all_gatherv(input_, dim, sizes)

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        """This rank's ``sizes[rank]`` rows along ``dim`` of the sum of every rank's
        ``input_`` (``sum(sizes)`` rows there; equal parts when ``sizes`` is None)."""
        rows = input_.movedim(dim, 0)
        sizes = self._checked_sizes(sizes, rows.shape[0], total=True)
        with micro_batch_collective():
            mine = self._reduce_scatter_rows(rows.contiguous(), sizes)
        return mine.movedim(0, dim)

    def _all_gatherv(self, input_: torch.Tensor, dim: int, sizes: list[int] | None) -> torch.Tensor:
        rows = input_.movedim(dim, 0)
        sizes = self._checked_sizes(sizes, rows.shape[0], total=False)
        longest, tail = max(sizes), rows.shape[1:]
        padded = rows.new_zeros((longest, *tail))
        padded[: rows.shape[0]] = rows
        gathered = rows.new_empty((self.world_size * longest, *tail))
        self._all_gather_equal(gathered, padded)
        parts = gathered.view(self.world_size, longest, *tail)
        return torch.cat([parts[rank, :n] for rank, n in enumerate(sizes)]).movedim(0, dim)

    def _checked_sizes(self, sizes: list[int] | None, rows: int, total: bool) -> list[int]:
        """``sizes`` (one row count per rank), or equal parts of ``rows``; ``ValueError``
        when they do not fit: ``rows`` must be their sum (``total``) or this rank's."""
        world = self.world_size
        if sizes is None:
            if total and rows % world:
                raise ValueError(f"{rows} rows do not split into {world} equal parts")
            return [rows // world if total else rows] * world
        if len(sizes) != world:
            raise ValueError(f"sizes must give {world} ranks' row counts, got {sizes}")
        expected = sum(sizes) if total else sizes[self.rank_in_group]
        if rows != expected:
            raise ValueError(f"expected {expected} rows along the collective's dim, got {rows}")
        return list(sizes)

    # vLLM's MoE dispatch and combine: through the all-to-all manager where the group
    # has one, else vLLM's base class (which hands the tensors back).
    def dispatch_router_logits(self, *args: Any, **kwargs: Any) -> Any:
        if self.all2all_manager is None:
            return super().dispatch_router_logits(*args, **kwargs)  # type: ignore[misc]
        return self.all2all_manager.dispatch_router_logits(*args, **kwargs)

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        if self.all2all_manager is None:
            return super().dispatch(*args, **kwargs)  # type: ignore[misc]
        return self.all2all_manager.dispatch(*args, **kwargs)

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        if self.all2all_manager is None:
            return super().combine(*args, **kwargs)  # type: ignore[misc]
        return self.all2all_manager.combine(*args, **kwargs)
