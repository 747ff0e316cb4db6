"""Batches for every attention state, an independent dense oracle, and a runner.

``build_batch`` makes a paged batch (random block ids, context already in the
cache, the step's new K/V still to write, optional graph padding); ``dense_reference``
computes the expected output in float64 from each request's full, unpaged K/V;
``run_provider`` plans and runs one layer through ``npu_attention`` with the
named provider and returns the output and the caches it wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from npu_attention import AttentionSpec, BatchState, plan, run
from npu_attention.providers.ascend import AscendProvider

DTYPE_TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


class HostAscendProvider(AscendProvider):
    """The ascend provider accepting CPU tensors, for runs against a stand-in torch_npu."""

    device_types = ("npu", "cpu")


@dataclass(frozen=True)
class Case:
    """One step: per request, tokens already cached and tokens new this step."""

    name: str
    state: BatchState
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_decodes: int = 0
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: torch.dtype = torch.float16
    causal: bool = True
    sliding_window: int | None = None
    num_speculative_tokens: int = 0
    padding: int = 0  # graph padding tokens after the real ones (slot -1)
    with_cache: bool = True

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=128,
            dtype=self.dtype,
            causal=self.causal,
            sliding_window=self.sliding_window,
            num_speculative_tokens=self.num_speculative_tokens,
        )


CASES = (
    Case("prefill_no_cache", BatchState.PREFILL_NO_CACHE, (0, 0, 0), (5, 140, 9)),
    Case(
        "prefill_cache_hit",
        BatchState.PREFILL_CACHE_HIT,
        (131, 0, 40),
        (7, 12, 90),
        dtype=torch.bfloat16,
    ),
    Case(
        "decode_only",
        BatchState.DECODE_ONLY,
        (0, 129, 255, 17),
        (1, 1, 1, 1),
        num_decodes=4,
        padding=4,
    ),
    Case(
        "spec_decoding",
        BatchState.SPEC_DECODING,
        (10, 300, 127),
        (3, 3, 3),
        num_decodes=3,
        num_speculative_tokens=2,
        head_size=128,
        num_kv_heads=8,
    ),
    Case(
        "chunked_prefill",
        BatchState.CHUNKED_PREFILL,
        (60, 200, 130, 0),
        (1, 1, 33, 20),
        num_decodes=2,
        padding=3,
        num_kv_heads=1,
    ),
    Case(
        "chunked_prefill_window",
        BatchState.CHUNKED_PREFILL,
        (60, 200, 130, 0),
        (1, 1, 33, 50),
        num_decodes=2,
        sliding_window=37,
    ),
    Case(
        "prefill_cache_hit_window",
        BatchState.PREFILL_CACHE_HIT,
        (150, 3),
        (40, 70),
        sliding_window=64,
        dtype=torch.bfloat16,
    ),
    Case(
        "decode_window",
        BatchState.DECODE_ONLY,
        (300, 20),
        (1, 1),
        num_decodes=2,
        sliding_window=100,
    ),
    Case("non_causal_paged", BatchState.PREFILL_CACHE_HIT, (40, 0), (20, 30), causal=False),
    Case(
        "encoder_no_cache",
        BatchState.PREFILL_NO_CACHE,
        (0, 0, 0),
        (7, 30, 1),
        causal=False,
        with_cache=False,
        padding=2,
    ),
    Case("causal_no_cache", BatchState.PREFILL_NO_CACHE, (0, 0), (33, 6), with_cache=False),
)


@dataclass
class Batch:
    case: Case
    cu_seqlens_q: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens], -1 for padding
    query: torch.Tensor  # [num_tokens, H, D]
    key: torch.Tensor  # [num_tokens, KV, D], the step's new keys
    value: torch.Tensor
    key_cache: torch.Tensor | None  # [num_blocks, 128, KV, D], context already written
    value_cache: torch.Tensor | None
    full_keys: list[torch.Tensor]  # per request [seq_len, KV, D]
    full_values: list[torch.Tensor]


def build_batch(case: Case, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    spec = case.spec

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(spec.dtype)

    seq_lens = [c + q for c, q in zip(case.context_lens, case.query_lens)]
    blocks_per_req = [math.ceil(s / spec.block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    ids = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    start = 0
    for r, count in enumerate(blocks_per_req):
        tables[r, :count] = ids[start : start + count]
        start += count
    num_real = sum(case.query_lens)
    full_keys = [randn(s, case.num_kv_heads, case.head_size) for s in seq_lens]
    full_values = [randn(s, case.num_kv_heads, case.head_size) for s in seq_lens]
    cache_shape = (num_blocks, spec.block_size, case.num_kv_heads, case.head_size)
    key_cache, value_cache = randn(*cache_shape), randn(*cache_shape)
    slots = torch.full((num_real + case.padding,), -1, dtype=torch.int64)
    new_keys, new_values = [], []
    token = 0
    for r, (context, seq_len) in enumerate(zip(case.context_lens, seq_lens)):
        for pos in range(seq_len):
            slot = int(tables[r, pos // spec.block_size]) * spec.block_size + pos % spec.block_size
            if pos < context:
                key_cache.view(-1, *cache_shape[2:])[slot] = full_keys[r][pos]
                value_cache.view(-1, *cache_shape[2:])[slot] = full_values[r][pos]
            else:
                slots[token] = slot
                token += 1
        new_keys.append(full_keys[r][context:])
        new_values.append(full_values[r][context:])
    pad = (case.padding, case.num_kv_heads, case.head_size)
    return Batch(
        case=case,
        cu_seqlens_q=[0, *torch.tensor(case.query_lens).cumsum(0).tolist()],
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=slots,
        query=randn(num_real + case.padding, case.num_heads, case.head_size),
        key=torch.cat([*new_keys, randn(*pad)]),
        value=torch.cat([*new_values, randn(*pad)]),
        key_cache=key_cache if case.with_cache else None,
        value_cache=value_cache if case.with_cache else None,
        full_keys=full_keys,
        full_values=full_values,
    )


def dense_reference(batch: Batch) -> torch.Tensor:
    """Expected output rows of the real tokens, float64, from unpaged K/V."""
    case, spec = batch.case, batch.case.spec
    rows = []
    for r, (context, seq_len) in enumerate(zip(case.context_lens, batch.seq_lens)):
        start, end = batch.cu_seqlens_q[r], batch.cu_seqlens_q[r + 1]
        q = batch.query[start:end].double()
        group = case.num_heads // case.num_kv_heads
        k = batch.full_keys[r].double().repeat_interleave(group, dim=1)
        v = batch.full_values[r].double().repeat_interleave(group, dim=1)
        positions = torch.arange(context, seq_len).unsqueeze(1)
        keys = torch.arange(seq_len).unsqueeze(0)
        visible = torch.ones(end - start, seq_len, dtype=torch.bool)
        if case.causal:
            visible &= keys <= positions
        if case.sliding_window is not None:
            visible &= keys > positions - case.sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * spec.softmax_scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        rows.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(rows)


@dataclass
class Outcome:
    out: torch.Tensor
    key_cache: torch.Tensor | None
    value_cache: torch.Tensor | None


def run_provider(batch: Batch, provider: str) -> Outcome:
    """Plan the step and run one layer with ``provider``; inputs are not modified."""
    key_cache = None if batch.key_cache is None else batch.key_cache.clone()
    value_cache = None if batch.value_cache is None else batch.value_cache.clone()
    with_cache = batch.case.with_cache
    step = plan(
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.block_tables if with_cache else None,
        batch.slot_mapping if with_cache else None,
        batch.case.num_decodes,
        batch.case.spec,
        provider=provider,
    )
    assert step.state is batch.case.state, (step.state, batch.case.state)
    out = torch.zeros_like(batch.query)
    run(batch.query, batch.key, batch.value, key_cache, value_cache, step, out)
    return Outcome(out, key_cache, value_cache)


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest elementwise |actual - expected| / (1 + |expected|)."""
    difference = (actual.double() - expected.double()).abs() / (1 + expected.double().abs())
    return float(difference.max()) if difference.numel() else 0.0
