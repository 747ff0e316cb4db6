"""Decode context parallelism (``decode_context_parallel_size``) for MLA layers.

Under DCP each of the N ranks of vLLM's DCP group keeps every N-th run of
``cp_kv_cache_interleave_size`` latents of every request (vLLM's slot mapping gives
``-1`` to the tokens another rank keeps; the block table is the same on every rank).
vLLM's ``MLAAttention`` layer does the model side of one layer's attention: it
absorbs ``W_UK`` into the decode queries, calls its ``dcp_manager`` to all-gather
them over the group (``query_gather``), calls the impl's ``forward_mqa`` for each
rank's partial attention and its log-sum-exp, combines the ranks' parts
(``dcp_manager.combine``) and up-projects with ``W_UV``. vLLM's manager runs Triton
or CUDA kernels; the bridge installs :class:`BridgeMLADCP` in its place (collectives
as custom ops that host graphs record whole, npu-attention's merge).

Every row of a step is an absorbed decode under DCP: the builder plans each query
token as its own one-token request (``plan_mla_dcp``) whose KV length is the number
of the rank's latents at or before the token's position, so prefill and chunked
prefill rows stay causal and vLLM's layer sends every row to ``forward_mqa``
(``num_decode_tokens`` is every row). Graph-padding rows get KV length 0 (LSE
``-inf``, zero output) on every rank. That KV-length list is the step argument a
FULL graph's decode task is updated with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from npu_attention import AttentionPlan, plan_context
from npu_attention.context_parallel import dcp_local_seq_lens
from npu_attention.mla import MLASpec
from npu_vllm_bridge.attention.context_parallel import DCPLayout, gather_heads, merge_rank_parts
from npu_vllm_bridge.attention.padding_slots import SLOT_HANDLING


def plan_mla_dcp(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    spec: MLASpec,
    layout: DCPLayout,
    *,
    device: torch.device | None = None,
    provider: str | None = None,
    table_rows: torch.Tensor | None = None,
) -> AttentionPlan:
    """One rank's plan of a step: every token a one-token decode over the rank's share.

    Args:
        query_lens, seq_lens: per-request host lists (global lengths, the same on every
            rank); requests of query length 0 (graph padding) bring no token.
        block_tables: ``[num_reqs, max_blocks]``, the same on every rank.
        slot_mapping: ``[num_tokens]``, this rank's slots (``-1``: another rank's token);
            the plan's latent write uses it.
        num_tokens: rows of the step, graph padding included (they see no key).
        spec: the layer group's ``MLASpec`` with this rank's heads; the plan's has the
            gathered ``N * size`` heads.
        table_rows: ``[max_tokens, max_blocks]`` with ``block_tables``' dtype, device and
            width: every row's block table is gathered into its first ``num_tokens`` rows,
            so each step's plan reads the same tensor (a FULL graph's decode task is
            re-issued on the tensors of its capture). ``None``: a new tensor each step.

    Raises:
        ValueError: more tokens than the requests hold or ``table_rows`` has rows, or a
            ``table_rows`` of another dtype, device or width than ``block_tables``.
    """
    query = np.asarray(query_lens, dtype=np.int64)
    request = np.repeat(np.arange(len(query)), query)
    starts = np.repeat(np.cumsum(query) - query, query)
    context = np.repeat(np.asarray(seq_lens, dtype=np.int64) - query, query)
    positions = context + np.arange(len(request)) - starts
    if len(request) > num_tokens:
        raise ValueError(f"the step's requests hold {len(request)} tokens, above {num_tokens}")
    visible = np.zeros(num_tokens, dtype=np.int64)
    visible[: len(request)] = dcp_local_seq_lens(
        positions + 1, layout.size, layout.interleave, layout.rank
    )
    rows = np.zeros(num_tokens, dtype=np.int64)
    rows[: len(request)] = request
    index = torch.from_numpy(rows).to(block_tables.device)
    gathered = dataclasses.replace(spec, num_heads=spec.num_heads * layout.size)
    return plan_context(
        np.arange(num_tokens + 1),
        visible,
        gather_table_rows(block_tables, index, table_rows),
        num_tokens,
        gathered,
        device=device,
        provider=provider,
        slot_mapping=slot_mapping,
        **SLOT_HANDLING,
    )


def gather_table_rows(
    block_tables: torch.Tensor, index: torch.Tensor, table_rows: torch.Tensor | None
) -> torch.Tensor:
    """``block_tables[index]``, written into the first ``len(index)`` rows of
    ``table_rows`` when given (see ``plan_mla_dcp``)."""
    if table_rows is None:
        return block_tables.index_select(0, index)
    rows = index.shape[0]
    fits = (
        table_rows.dtype == block_tables.dtype
        and table_rows.device == block_tables.device
        and table_rows.dim() == 2
        and table_rows.shape[1] == block_tables.shape[1]
        and table_rows.shape[0] >= rows
    )
    if not fits:
        raise ValueError(
            f"table_rows must be at least [{rows}, {block_tables.shape[1]}] "
            f"{block_tables.dtype} on {block_tables.device}, got "
            f"{list(table_rows.shape)} {table_rows.dtype} on {table_rows.device}"
        )
    out = table_rows[:rows]
    torch.index_select(block_tables, 0, index, out=out)
    return out


class BridgeMLADCP:
    """What vLLM's ``MLAAttention`` asks of its ``dcp_manager``, without Triton.

    Args:
        group: vLLM's DCP ``GroupCoordinator`` (``world_size``, ``device_group``).
    """

    def __init__(self, group: Any) -> None:
        self.group = group

    def query_gather(self, query: torch.Tensor) -> torch.Tensor:
        """``[T, N, W]`` -> ``[T, size * N, W]``, rank-major heads (vLLM's order)."""
        return gather_heads(query, self.group)

    def combine(
        self,
        partial_output: torch.Tensor,
        partial_lse: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Merge every rank's partial attention of this rank's heads.

        Args:
            partial_output: ``[T, size * N, L]``, this rank's part for every gathered head.
            partial_lse: float32 ``[T, size * N]`` (natural log).
            seq_lens, query_start_loc: vLLM's arguments, unused (the LSE says it all).

        Returns:
            ``[T, N, L]`` in ``partial_output``'s dtype.
        """
        tokens, heads_all, width = partial_output.shape
        out = partial_output.new_empty((tokens, heads_all // self.group.world_size, width))
        merge_rank_parts(partial_output, partial_lse, self.group, out)
        return out
