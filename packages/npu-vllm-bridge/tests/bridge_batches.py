"""vLLM-style attention batches for the bridge's unit tests, and a naive reference.

A batch is a list of requests ``(context_len, query_len)``; decodes first, as vLLM's
reorder puts them. Block ids are drawn at random from a pool, so requests' pages
are scattered as in a real cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64


@dataclass
class Batch:
    common: CommonAttentionMetadata
    query: torch.Tensor  # [tokens, heads, dim]
    key: torch.Tensor  # [tokens, kv_heads, dim], the step's new keys
    value: torch.Tensor
    context_keys: list[torch.Tensor]  # per request [context_len, kv_heads, dim]
    context_values: list[torch.Tensor]
    requests: list[tuple[int, int]]


def packed_kv_cache(num_blocks: int, block_size: int, physical: str = "LBNHC") -> torch.Tensor:
    """vLLM's per-layer cache: logical ``[blocks, kv_heads, block_size, 2 * dim]``,
    allocated in the physical order vLLM uses for ``physical`` and permuted back."""
    if physical == "LBNHC":
        raw = torch.full((num_blocks, block_size, NUM_KV_HEADS, 2 * HEAD_SIZE), float("nan"))
        return raw.permute(0, 2, 1, 3)
    return torch.full((num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE), float("nan"))


def kv_views(kv_cache: torch.Tensor, split: str = "packed") -> tuple[torch.Tensor, torch.Tensor]:
    """``[blocks, block_size, kv_heads, dim]`` K and V views of a packed cache as the
    bridge lays pages out: ``packed`` (K|V in the last dim) or ``planes`` (the layer's
    region holds all K, then all V)."""
    if split == "packed":
        by_token = kv_cache.transpose(1, 2)
        return by_token[..., :HEAD_SIZE], by_token[..., HEAD_SIZE:]
    blocks, heads, block_size, _ = kv_cache.shape
    flat = kv_cache.as_strided((kv_cache.numel(),), (1,), kv_cache.storage_offset())
    planes = flat.view(2, blocks, block_size, heads, HEAD_SIZE)
    return planes[0], planes[1]


def make_batch(
    requests: list[tuple[int, int]],
    kv_cache: torch.Tensor,
    block_size: int,
    generator: torch.Generator,
    pad_tokens: int = 0,
    split: str = "packed",
) -> Batch:
    """Write each request's context K/V into ``kv_cache`` and describe the step as
    vLLM's ``CommonAttentionMetadata`` (``pad_tokens`` extra slot -1 rows at the end)."""
    num_blocks = kv_cache.shape[0]
    blocks_needed = [-(-(c + q) // block_size) for c, q in requests]
    width = max(blocks_needed)
    perm = torch.randperm(num_blocks - 1, generator=generator) + 1  # block 0: vLLM's null block
    assert sum(blocks_needed) <= len(perm)
    block_table = torch.zeros(len(requests), width, dtype=torch.int32)
    slots, cursor = [], 0
    context_keys, context_values = [], []
    k_view, v_view = kv_views(kv_cache, split)
    for i, (context_len, query_len) in enumerate(requests):
        ids = perm[cursor : cursor + blocks_needed[i]]
        cursor += blocks_needed[i]
        block_table[i, : len(ids)] = ids.to(torch.int32)
        ck = torch.randn(context_len, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
        cv = torch.randn(context_len, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
        for pos in range(context_len):
            block, offset = ids[pos // block_size], pos % block_size
            k_view[block, offset] = ck[pos]
            v_view[block, offset] = cv[pos]
        context_keys.append(ck)
        context_values.append(cv)
        for pos in range(context_len, context_len + query_len):
            slots.append(int(ids[pos // block_size]) * block_size + pos % block_size)
    num_tokens = len(slots) + pad_tokens
    slot_mapping = torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64)
    cu = torch.zeros(len(requests) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([q for _, q in requests]), 0)
    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=cu.clone(),
        query_start_loc_cpu=cu,
        seq_lens=seq_lens.clone(),
        seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=len(requests),
        num_actual_tokens=num_tokens,
        max_query_len=max(q for _, q in requests),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
    )
    return Batch(
        common=common,
        query=torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=generator),
        key=torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=generator),
        value=torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=generator),
        context_keys=context_keys,
        context_values=context_values,
        requests=requests,
    )


def naive_attention(batch: Batch, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Dense causal attention in float64, request by request, from the raw K/V."""
    out = torch.zeros(batch.common.num_actual_tokens, NUM_HEADS, HEAD_SIZE, dtype=torch.float64)
    group = NUM_HEADS // NUM_KV_HEADS
    start = 0
    for i, (context_len, query_len) in enumerate(batch.requests):
        rows = slice(start, start + query_len)
        keys = torch.cat([batch.context_keys[i], batch.key[rows]]).double()
        values = torch.cat([batch.context_values[i], batch.value[rows]]).double()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        q = batch.query[rows].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        q_pos = torch.arange(context_len, context_len + query_len)[:, None]
        k_pos = torch.arange(context_len + query_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        start += query_len
    return out
