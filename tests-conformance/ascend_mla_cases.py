"""MLA batches for every state at DeepSeek-V3 widths, a float64 MLA oracle, and a runner.

``build_mla_batch`` makes a paged latent cache (two contiguous planes, random block
ids, context already written, unused rows NaN), the step's new latents and queries
and a kv_b up-projection; ``mla_reference`` computes the expected decode (latent
space) and prefill outputs in float64 from each request's unpaged latents;
``run_mla_provider`` plans and runs one layer through ``npu_attention.mla``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from npu_attention import BatchState, plan
from npu_attention.mla import (
    LatentCache,
    MLASpec,
    allocate_latent_cache,
    mla_decode,
    mla_prefill,
    mla_write_cache,
)
from npu_attention.providers.ascend_mla import AscendMLAProvider

LATENT, ROPE, NOPE, VALUE = 512, 64, 128, 128


class HostAscendMLAProvider(AscendMLAProvider):
    """The ascend MLA provider accepting CPU tensors, for runs against a stand-in torch_npu."""

    device_types = ("npu", "cpu")


@dataclass(frozen=True)
class MLACase:
    name: str
    state: BatchState
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_decodes: int = 0
    num_heads: int = 32
    block_size: int = 128
    dtype: torch.dtype = torch.bfloat16
    num_speculative_tokens: int = 0
    padding: int = 0

    @property
    def spec(self) -> MLASpec:
        return MLASpec(
            num_heads=self.num_heads,
            kv_lora_rank=LATENT,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            v_head_dim=VALUE,
            block_size=self.block_size,
            dtype=self.dtype,
            num_speculative_tokens=self.num_speculative_tokens,
        )


MLA_CASES = (
    MLACase("prefill_no_cache", BatchState.PREFILL_NO_CACHE, (0, 0), (5, 20)),
    MLACase(
        "prefill_cache_hit",
        BatchState.PREFILL_CACHE_HIT,
        (40, 3),
        (7, 12),
        num_heads=16,
        block_size=16,
    ),
    MLACase(
        "chunked_prefill",
        BatchState.CHUNKED_PREFILL,
        (30, 140, 17, 0),
        (1, 1, 9, 6),
        num_decodes=2,
        num_heads=16,
        block_size=16,
        dtype=torch.float16,
        padding=2,
    ),
    MLACase(
        "decode_only", BatchState.DECODE_ONLY, (0, 150, 20), (1, 1, 1), num_decodes=3, padding=3
    ),
    MLACase(
        "spec_decoding",
        BatchState.SPEC_DECODING,
        (12, 40),
        (3, 3),
        num_decodes=2,
        num_heads=64,
        block_size=16,
        num_speculative_tokens=2,
    ),
)
# tolerance of max_error (|a - e| / (1 + |e|)) against the float64 oracle
MLA_TOLERANCE = {torch.float16: 2.5e-2, torch.bfloat16: 2.5e-2}


@dataclass
class MLABatch:
    case: MLACase
    cu_seqlens_q: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens + padding]
    cache: LatentCache  # context written, the rest NaN
    kv_c: torch.Tensor  # [num_tokens + padding, L], the step's new latents
    k_pe: torch.Tensor  # [num_tokens + padding, R]
    q_latent: torch.Tensor  # [decode tokens + padding, N, L]
    q_rope: torch.Tensor  # [decode tokens + padding, N, R]
    query: torch.Tensor  # [prefill tokens + padding, N, P + R]
    kv_b_weight: torch.Tensor  # [N * (P + V), L]
    latents: list[torch.Tensor]  # per request [seq_len, L + R]

    def kv_up_proj(self, kv_c: torch.Tensor) -> torch.Tensor:
        return kv_c @ self.kv_b_weight.T


def build_mla_batch(case: MLACase, seed: int = 0) -> MLABatch:
    generator = torch.Generator().manual_seed(seed)
    spec = case.spec

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(spec.dtype)

    seq_lens = [c + q for c, q in zip(case.context_lens, case.query_lens)]
    blocks_per_req = [math.ceil(s / spec.block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    ids = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    start = 0
    for r, count in enumerate(blocks_per_req):
        tables[r, :count] = ids[start : start + count]
        start += count
    cache = allocate_latent_cache(num_blocks, spec)
    cache.kv_c.fill_(float("nan"))
    cache.k_pe.fill_(float("nan"))
    latents = [randn(s, LATENT + ROPE) for s in seq_lens]
    slots = []
    for r, (context, seq_len) in enumerate(zip(case.context_lens, seq_lens)):
        for pos in range(seq_len):
            block, row = int(tables[r, pos // spec.block_size]), pos % spec.block_size
            if pos < context:
                cache.kv_c[block, row] = latents[r][pos, :LATENT]
                cache.k_pe[block, row] = latents[r][pos, LATENT:]
            else:
                slots.append(block * spec.block_size + row)
    new = torch.cat([lat[c:] for lat, c in zip(latents, case.context_lens)])
    new = torch.cat([new, randn(case.padding, LATENT + ROPE)])
    decode_tokens = sum(case.query_lens[: case.num_decodes])
    prefill_tokens = sum(case.query_lens) - decode_tokens
    return MLABatch(
        case=case,
        cu_seqlens_q=[0, *torch.tensor(case.query_lens).cumsum(0).tolist()],
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=torch.tensor(slots + [-1] * case.padding, dtype=torch.int64),
        cache=cache,
        kv_c=new[:, :LATENT].contiguous(),
        k_pe=new[:, LATENT:].contiguous(),
        q_latent=randn(decode_tokens + case.padding, case.num_heads, LATENT),
        q_rope=randn(decode_tokens + case.padding, case.num_heads, ROPE),
        query=randn(prefill_tokens + case.padding, case.num_heads, NOPE + ROPE),
        kv_b_weight=randn(case.num_heads * (NOPE + VALUE), LATENT, scale=LATENT**-0.5),
        latents=latents,
    )


def mla_reference(batch: MLABatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected decode ``[decode tokens, N, L]`` and prefill ``[prefill tokens, N, V]``
    rows in float64: absorbed MQA over latents, decompressed causal attention."""
    case, scale = batch.case, batch.case.spec.softmax_scale
    decode_rows, prefill_rows = [], []
    first_prefill = batch.cu_seqlens_q[case.num_decodes]
    weight = batch.kv_b_weight.double().view(case.num_heads, NOPE + VALUE, LATENT)
    for r, context in enumerate(case.context_lens):
        latent = batch.latents[r].double()
        start, end = batch.cu_seqlens_q[r], batch.cu_seqlens_q[r + 1]
        visible = (
            torch.arange(latent.shape[0])[None, :]
            <= torch.arange(context, context + end - start)[:, None]
        )
        if r < case.num_decodes:
            q = torch.cat([batch.q_latent[start:end], batch.q_rope[start:end]], -1).double()
            scores = torch.einsum("qnd,kd->nqk", q, latent) * scale
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            decode_rows.append(torch.einsum("nqk,kd->qnd", probs, latent[:, :LATENT]))
            continue
        heads = torch.einsum("kl,nwl->knw", latent[:, :LATENT], weight)
        heads = heads.to(case.dtype).double()  # kv_up_proj runs in the model dtype
        k_nope, v = heads.split([NOPE, VALUE], -1)
        k = torch.cat([k_nope, latent[:, None, LATENT:].expand(-1, case.num_heads, -1)], -1)
        q = batch.query[start - first_prefill : end - first_prefill].double()
        scores = torch.einsum("qnd,knd->nqk", q, k) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        prefill_rows.append(torch.einsum("nqk,knd->qnd", probs, v))
    empty = torch.zeros(0, case.num_heads, LATENT, dtype=torch.float64)
    return (
        torch.cat(decode_rows) if decode_rows else empty,
        torch.cat(prefill_rows) if prefill_rows else empty[..., :VALUE],
    )


@dataclass
class MLAOutcome:
    decode_out: torch.Tensor
    prefill_out: torch.Tensor
    cache: LatentCache


def run_mla_provider(batch: MLABatch, provider: str) -> MLAOutcome:
    """Plan the step and run one layer (write, decode, prefill); inputs are not modified."""
    cache = LatentCache(batch.cache.kv_c.clone(), batch.cache.k_pe.clone())
    step = plan(
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.block_tables,
        batch.slot_mapping,
        batch.case.num_decodes,
        batch.case.spec,
        provider=provider,
    )
    assert step.state is batch.case.state, (step.state, batch.case.state)
    decode_out = torch.zeros_like(batch.q_latent)
    prefill_out = batch.query.new_zeros(*batch.query.shape[:2], VALUE)
    mla_write_cache(batch.kv_c, batch.k_pe, cache, step)
    mla_decode(batch.q_latent, batch.q_rope, cache, step, decode_out)
    mla_prefill(batch.query, cache, step, batch.kv_up_proj, prefill_out)
    return MLAOutcome(decode_out, prefill_out, cache)
