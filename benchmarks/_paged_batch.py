"""Random paged batches for the attention benchmarks: dense K/V laid into pages.

A batch keeps its dense ``[batch, kv_heads, seq, head_size]`` K/V (what SDPA
reads) and the same data in a paged cache whose pages are a random permutation
of blocks ``1..`` (block 0 reserved), with an ``AttentionPlan`` built by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npu_attention.plan import AttentionPlan
from npu_attention.spec import AttentionSpec, BatchState


@dataclass
class PagedBatch:
    plan: AttentionPlan
    query: torch.Tensor  # [tokens, heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_size]
    value_cache: torch.Tensor


def page_kv(dense: torch.Tensor, block_size: int, block_tables: torch.Tensor) -> torch.Tensor:
    """Lay ``dense`` ``[batch, kv_heads, seq, d]`` (seq a multiple of ``block_size``)
    into a new cache along ``block_tables`` ``[batch, seq // block_size]``."""
    batch, kv_heads, seq, head_size = dense.shape
    num_blocks = 1 + int(block_tables.max())
    cache = torch.empty(
        num_blocks, block_size, kv_heads, head_size, dtype=dense.dtype, device=dense.device
    )
    cache[0].fill_(float("nan"))
    for b in range(batch):  # one request at a time keeps the transposed copy small
        pages = dense[b].transpose(0, 1).reshape(seq // block_size, block_size, kv_heads, head_size)
        cache[block_tables[b].long()] = pages
    return cache


def permuted_block_tables(
    batch: int, pages_per_req: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """int32 ``[batch, pages_per_req]``: a random permutation of blocks ``1..``."""
    order = torch.randperm(batch * pages_per_req, generator=generator) + 1
    return order.view(batch, pages_per_req).to(torch.int32).to(device)


def hand_plan(
    spec: AttentionSpec,
    provider: object,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    num_decodes: int,
) -> AttentionPlan:
    """An ``AttentionPlan`` for a batch whose new tokens are already cached."""
    device = block_tables.device
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    context = [s - q for s, q in zip(seq_lens, query_lens)]
    if num_decodes == len(query_lens):
        state = BatchState.DECODE_ONLY if max(query_lens) == 1 else BatchState.SPEC_DECODING
    else:
        state = BatchState.PREFILL_CACHE_HIT if any(context) else BatchState.PREFILL_NO_CACHE
    slots = torch.full((cu[-1],), -1, dtype=torch.int64, device=device)
    plan = AttentionPlan(
        spec=spec,
        state=state,
        provider=provider,
        device=device,
        num_reqs=len(query_lens),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes * (1 + spec.num_speculative_tokens),
        num_actual_tokens=cu[-1],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        cu_seqlens_q_host=cu,
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        device_context_lens=torch.tensor(context, dtype=torch.int32, device=device),
        block_tables=block_tables,
        slot_mapping=slots,
    )
    if hasattr(plan, "context_lens_host"):
        plan.context_lens_host, plan.max_context_len = context, max(context)
    plan.provider_data = provider.prepare(plan)
    return plan


def causal_pairs(query_len: int, seq_len: int) -> int:
    """(query, key) pairs a bottom-right causal mask keeps."""
    context = seq_len - query_len
    return query_len * context + query_len * (query_len + 1) // 2


def attention_flops(num_heads: int, head_size: int, pairs: int) -> int:
    """Multiply-adds of QK^T and PV, counted as 2 flops each, over the visible pairs."""
    return 4 * num_heads * head_size * pairs


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
