"""Decode context parallelism (vLLM's ``decode_context_parallel_size``) for GQA/MQA.

Under DCP the N ranks of vLLM's DCP group (a slice of the tensor-parallel ranks that
hold the same KV heads) each keep every N-th run of ``cp_kv_cache_interleave_size``
tokens of every request in their KV cache: vLLM's slot mapping gives ``-1`` to the
tokens another rank keeps, and the block table is the same on every rank. One layer's
attention on rank ``r``, as vLLM's FlashAttention backend computes it
(``_forward_with_dcp``), with npu-attention's kernels and merge in place of vLLM's
Triton/CUDA helpers (``cp_lse_ag_out_rs``, ``correct_attn_out``, ``merge_attn_states``):

1. the query (this rank's H heads) is all-gathered over the group: ``[T, N * H, D]``;
2. one updatable graph task runs two ``npu_attention.run`` calls: the gathered query
   over this rank's share of the context, with its LSE (``plan_context``, whose
   per-request lengths are the rank's local context lengths: the step argument a
   graph replay is updated with; the same call writes the rank's share of the new
   K/V), and this rank's heads over the step's new tokens, causal, with its LSE;
3. an all-to-all hands every rank the context outputs and LSEs of its own heads from
   every rank;
4. ``merge_attention_states`` merges the N context parts and the new-token part into
   the layer's output.

The collectives are custom ops that host graphs record whole
(``collectives.py``). vLLM forces ``reorder_batch_threshold = 1`` under
DCP, so decodes are single-token requests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

import npu_attention
from npu_attention import (
    AttentionPlan,
    AttentionSpec,
    dcp_local_seq_lens,
    merge_attention_states,
    plan_context,
)
from npu_vllm_bridge.attention.padding_slots import SLOT_HANDLING
from npu_vllm_bridge.attention.tasks import run_dcp_attention
from npu_vllm_bridge.collectives import all_gather_, all_to_all_


@dataclass(frozen=True)
class DCPLayout:
    """This rank's place in the DCP group: ``size`` ranks, ``rank``, and the run of
    consecutive tokens each rank keeps in turn (``cp_kv_cache_interleave_size``)."""

    size: int
    rank: int
    interleave: int = 1


@dataclass
class DCPPlans:
    """A step's two plans under DCP.

    Attributes:
        context_plan: the gathered query (``N * H`` heads) over this rank's context
            share: per-request lengths are the rank's local context lengths (0 for
            graph-padding requests); writes the rank's share of the new K/V.
        new_plan: this rank's ``H`` heads over the step's new tokens (no cache), causal.
        local_context_lens: ``context_plan``'s per-request lengths (host list).
    """

    context_plan: AttentionPlan
    new_plan: AttentionPlan
    local_context_lens: list[int]


def dcp_layout_of(vllm_config: Any, dcp_sharded: bool = True) -> DCPLayout | None:
    """This process's DCP layout, or ``None`` without DCP (or for a cache that is not
    sharded, as vLLM's replicated draft caches)."""
    from vllm.distributed.parallel_state import get_dcp_world_size_and_rank

    size, rank = get_dcp_world_size_and_rank(dcp_sharded)
    if size == 1:
        return None
    interleave = vllm_config.parallel_config.cp_kv_cache_interleave_size
    return DCPLayout(size, rank, interleave)


def plan_dcp(
    cu_seqlens_q: list[int],
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_decodes: int,
    spec: AttentionSpec,
    layout: DCPLayout,
    *,
    device: torch.device | None = None,
    provider: str | None = None,
) -> DCPPlans:
    """Plan one step on one DCP rank.

    Args:
        cu_seqlens_q, query_lens, seq_lens: host lists of the whole step (global
            sequence lengths, the same on every rank).
        block_tables: ``[num_reqs, max_blocks]``, the same on every rank.
        slot_mapping: ``[num_tokens]``, this rank's slots (``-1``: another rank's token).
        spec: the layer group's spec with this rank's heads.
    """
    context = [s - q for s, q in zip(seq_lens, query_lens)]
    local = dcp_local_seq_lens(context, layout.size, layout.interleave, layout.rank)
    gathered = dataclasses.replace(spec, num_heads=spec.num_heads * layout.size)
    context_plan = plan_context(
        cu_seqlens_q,
        local,
        block_tables,
        num_decodes,
        gathered,
        device=device,
        provider=provider,
        slot_mapping=slot_mapping,
        **SLOT_HANDLING,
    )
    new_plan = npu_attention.plan(
        cu_seqlens_q, query_lens, None, None, num_decodes, spec, device=device, provider=provider
    )
    return DCPPlans(context_plan, new_plan, local.tolist())


def dcp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    group: Any,
    attn_metadata: Any,
    *,
    layer_name: str,
) -> torch.Tensor:
    """One layer's attention under DCP (see the module doc); writes ``output``.

    Args:
        query: ``[T, H, D]``, this rank's heads (``T`` graph padding included).
        key, value: ``[T, kv_heads, D]``.
        output: ``[T, H, D]``; rows past the step's tokens get zeros.
        group: vLLM's DCP ``GroupCoordinator`` (``world_size``, ``device_group``).
        attn_metadata: the layer's metadata, with its ``dcp`` plans (the task's step).
        layer_name: the layer's name (the task's).
    """
    tokens, heads, _ = query.shape
    size, device = group.world_size, query.device
    q_all = gather_heads(query, group)
    context_out = torch.empty_like(q_all)
    context_lse = torch.full((tokens, size * heads), float("-inf"), device=device)
    new_out = torch.empty_like(query)
    new_lse = torch.full((tokens, heads), float("-inf"), device=device)
    run_dcp_attention(
        q_all,
        query,
        key,
        value,
        key_cache,
        value_cache,
        context_out,
        context_lse,
        new_out,
        new_lse,
        attn_metadata,
        layer_name=layer_name,
    )
    merge_rank_parts(context_out, context_lse, group, output[:tokens], (new_out, new_lse))
    return output


def gather_heads(query: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather the heads of the DCP group: ``[T, H, W]`` -> ``[T, size * H, W]``,
    rank-major (vLLM's order)."""
    tokens, heads, width = query.shape
    size = group.world_size
    gathered = query.new_empty((size * tokens, heads, width))
    all_gather_(gathered, query.contiguous(), group.device_group)
    return gathered.view(size, tokens, heads, width).transpose(0, 1).reshape(tokens, -1, width)


def merge_rank_parts(
    parts: torch.Tensor,
    lses: torch.Tensor,
    group: Any,
    out: torch.Tensor,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Merge the ranks' partial attention of this rank's heads into ``out``.

    Every rank attended the gathered heads of the whole group over its own KV share.
    An all-to-all hands rank ``j`` the outputs and LSEs of its heads from every rank,
    packed in one float32 tensor ``[rank, T, H, D + 1]`` (output, then LSE), and
    ``merge_attention_states`` weighs them (with ``local``, this rank's own
    ``([T, H, D], [T, H])`` part, as one more).

    Args:
        parts: ``[T, size * H, D]``, rank-major heads; lses: float32 ``[T, size * H]``.
        group: vLLM's DCP ``GroupCoordinator``.
        out: ``[T, H, D]``, written.
    """
    tokens, heads_all, head_size = parts.shape
    size = group.world_size
    heads = heads_all // size
    packed = torch.cat(
        [
            parts.view(tokens, size, heads, head_size).float(),
            lses.view(tokens, size, heads, 1),
        ],
        dim=-1,
    )
    send = packed.transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    all_to_all_(received, send, group.device_group)
    outputs, part_lses = received[..., :head_size], received[..., head_size]
    if local is not None:
        outputs = torch.cat([outputs, local[0].float().unsqueeze(0)])
        part_lses = torch.cat([part_lses, local[1].unsqueeze(0)])
    merge_attention_states(outputs, part_lses, out=out)
    return out
