"""Sharded attention for the context-parallel tests: one DCP rank's cache, the DCP and
PCP attention of a ``Case`` computed rank by rank, merged, compared with ``run``."""

from __future__ import annotations

import numpy as np
import torch
from npu_attention_cases import Case, PagedCase

from npu_attention import merge_attention_states, plan, plan_context, run
from npu_attention.context_parallel import (
    dcp_local_seq_lens,
    dcp_owner,
    dcp_slot_mapping,
    pcp_local_batch,
)


def dcp_rank_cache(
    case: Case, paged: PagedCase, dcp_size: int, rank: int, interleave: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s caches: NaN everywhere but its share of every request's context,
    laid out by the DCP slot mapping over the case's own block tables."""
    bs = case.spec.block_size
    key_cache = torch.full_like(paged.key_cache, float("nan"))
    value_cache = torch.full_like(paged.value_cache, float("nan"))
    tables = paged.block_tables.numpy()
    for i, ctx in enumerate(case.context_lens):
        pos = np.arange(ctx)
        slots = dcp_slot_mapping(pos, np.full(ctx, i), tables, bs, dcp_size, rank, interleave)
        mine = dcp_owner(pos, dcp_size, interleave) == rank
        slots_t = torch.from_numpy(slots[mine]).to(key_cache.device)
        keep = torch.from_numpy(np.flatnonzero(mine)).to(key_cache.device)
        key_cache[slots_t // bs, slots_t % bs] = case.keys[i].index_select(0, keep)
        value_cache[slots_t // bs, slots_t % bs] = case.values[i].index_select(0, keep)
    return key_cache, value_cache


def dcp_attention(
    case: Case,
    paged: PagedCase,
    dcp_size: int,
    interleave: int,
    provider: str,
    part_lses: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """DCP attention of ``case``: each rank's context share (``plan_context``, LSE),
    merged across ranks, then merged with the new tokens' causal attention."""
    device, n = case.query.device, case.num_tokens
    spec, heads = case.spec, case.spec.num_heads
    query = case.query[:n]
    context = dcp_local_seq_lens(case.context_lens, dcp_size, interleave)
    outs, lses = [], []
    for rank in range(dcp_size):
        key_cache, value_cache = dcp_rank_cache(case, paged, dcp_size, rank, interleave)
        step = plan_context(
            case.cu_seqlens_q,
            context[:, rank],
            paged.block_tables.to(device),
            case.num_decodes,
            spec,
            provider=provider,
        )
        out = torch.full_like(query, float("nan"))
        lse = torch.full((n, heads), float("nan"), device=device)
        run(query, None, None, key_cache, value_cache, step, out, lse=lse)
        outs.append(out)
        lses.append(lse)
    if part_lses is not None:
        part_lses.extend(lses)
    context_out, context_lse = merge_attention_states(torch.stack(outs), torch.stack(lses))
    new_step = plan(
        case.cu_seqlens_q,
        case.query_lens,
        None,
        None,
        case.num_decodes,
        spec,
        provider=provider,
        device=device,
    )
    key, value = case.new_kv()
    new_out = torch.full_like(query, float("nan"))
    new_lse = torch.full((n, heads), float("nan"), device=device)
    run(query, key[:n], value[:n], None, None, new_step, new_out, lse=new_lse)
    merged, _ = merge_attention_states(
        torch.stack([context_out, new_out]), torch.stack([context_lse, new_lse])
    )
    return merged


def pcp_attention(
    case: Case, paged: PagedCase, pcp_size: int, provider: str, dcp_size: int = 1
) -> torch.Tensor:
    """PCP attention of ``case`` (the whole cache on every rank): each rank plans and
    runs its query chunks, and its rows go back to their global tokens."""
    device, n = case.query.device, case.num_tokens
    # The full KV of the step on every rank, as vLLM's PCP gathers it before attention.
    key, value = case.new_kv()
    slots = paged.slot_mapping[:n].to(device)
    bs = case.spec.block_size
    key_cache, value_cache = paged.key_cache.clone(), paged.value_cache.clone()
    key_cache[slots // bs, slots % bs] = key[:n]
    value_cache[slots // bs, slots % bs] = value[:n]
    result = torch.full_like(case.query[:n], float("nan"))
    covered = torch.zeros(n, dtype=torch.int64)
    for rank in range(pcp_size):
        batch = pcp_local_batch(
            case.cu_seqlens_q, case.seq_lens, case.num_decodes, pcp_size, rank, dcp_size
        )
        if len(batch.tokens) == 0:
            continue
        tokens = torch.from_numpy(batch.tokens)
        step = plan(
            batch.cu_seqlens_q,
            batch.seq_lens,
            paged.block_tables[batch.request].to(device),
            None,
            batch.num_decodes,
            case.spec,
            provider=provider,
        )
        local_query = case.query.index_select(0, tokens.to(device))
        out = torch.full_like(local_query, float("nan"))
        run(local_query, None, None, key_cache, value_cache, step, out)
        result[tokens.to(device)] = out
        covered[tokens] += 1
    replicated = covered > 1  # decodes run on every rank; each rank's rows are the same
    assert bool((covered >= 1).all()), "some query token is computed by no rank"
    assert bool((covered[~replicated] == 1).all())
    return result
