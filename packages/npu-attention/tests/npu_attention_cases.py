"""Test batches with paged caches, and an independent dense float64 attention oracle.

A ``Case`` holds every request's full keys and values (context + new) unpaged;
``Case.paged`` lays the context into a cache whose pages are a random
permutation of blocks ``1..`` (block 0 reserved, never used) and whose unused
memory is NaN, so any read outside a request's pages shows up in the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from npu_attention import AttentionPlan, AttentionSpec, PlanBuffers, plan, run

# Tolerances of run (float32 accumulation, output rounded to dtype) against the
# float64 oracle fed the very same (dtype-rounded) inputs.
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@dataclass
class Case:
    spec: AttentionSpec
    query_lens: list[int]
    context_lens: list[int]
    num_decodes: int
    query: torch.Tensor  # [num_tokens + pad, heads, head_size]
    keys: list[torch.Tensor]  # per request [seq_len, kv_heads, head_size]
    values: list[torch.Tensor]
    pad_tokens: int

    @property
    def seq_lens(self) -> list[int]:
        return [q + c for q, c in zip(self.query_lens, self.context_lens)]

    @property
    def cu_seqlens_q(self) -> list[int]:
        return [0, *np.cumsum(self.query_lens).tolist()]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's new keys and values in token order, plus padding rows."""
        keys = [k[c:] for k, c in zip(self.keys, self.context_lens)]
        values = [v[c:] for v, c in zip(self.values, self.context_lens)]
        pad = self.query.new_full(
            (self.pad_tokens, self.spec.num_kv_heads, self.spec.head_size), 7.0
        )
        return torch.cat([*keys, pad]), torch.cat([*values, pad])

    def paged(
        self, rng: np.random.Generator, *, packed: bool = False, extra_columns: int = 1
    ) -> PagedCase:
        """Caches holding the context, block tables and the slot mapping of new tokens."""
        spec, bs = self.spec, self.spec.block_size
        blocks_per_req = [-(-s // bs) for s in self.seq_lens]
        num_blocks = 1 + sum(blocks_per_req) + 2
        pages = 1 + rng.permutation(num_blocks - 1)
        width = max(blocks_per_req, default=0) + extra_columns
        tables = np.zeros((len(self.seq_lens), width), dtype=np.int64)
        start = 0
        for i, n in enumerate(blocks_per_req):
            tables[i, :n] = pages[start : start + n]
            start += n
        key_cache, value_cache = _nan_caches(spec, num_blocks, packed, self.query.device)
        slots = []
        for i, (ctx, seq) in enumerate(zip(self.context_lens, self.seq_lens)):
            pos = np.arange(seq)
            req_slots = tables[i, pos // bs] * bs + pos % bs
            blocks = torch.from_numpy(req_slots[:ctx] // bs).to(key_cache.device)
            offsets = torch.from_numpy(req_slots[:ctx] % bs).to(key_cache.device)
            key_cache[blocks, offsets] = self.keys[i][:ctx]
            value_cache[blocks, offsets] = self.values[i][:ctx]
            slots.extend(req_slots[ctx:].tolist())
        slots.extend([-1] * self.pad_tokens)
        return PagedCase(
            torch.from_numpy(tables),
            torch.tensor(slots, dtype=torch.int64),
            key_cache,
            value_cache,
            num_blocks,
        )


@dataclass
class PagedCase:
    block_tables: torch.Tensor  # int64 [num_reqs, width], host
    slot_mapping: torch.Tensor  # int64 [num_tokens + pad], host
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_size]
    value_cache: torch.Tensor
    num_blocks: int


def make_case(
    spec: AttentionSpec,
    query_lens: list[int],
    context_lens: list[int],
    num_decodes: int,
    *,
    seed: int = 0,
    pad_tokens: int = 0,
    device: str | torch.device = "cpu",
) -> Case:
    """Random queries and per-request keys/values, rounded to ``spec.dtype``."""
    gen = torch.Generator().manual_seed(seed)
    h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(spec.dtype).to(device)

    num_tokens = sum(query_lens)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    return Case(
        spec=spec,
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        num_decodes=num_decodes,
        query=rand(num_tokens + pad_tokens, h, d),
        keys=[rand(s, kvh, d) for s in seq_lens],
        values=[rand(s, kvh, d) for s in seq_lens],
        pad_tokens=pad_tokens,
    )


def naive_attention(case: Case) -> torch.Tensor:
    """Dense float64 attention, one request and one query at a time: ``[num_tokens, h, d]``."""
    spec = case.spec
    group = spec.num_heads // spec.num_kv_heads
    rows = []
    for i, (ctx, seq) in enumerate(zip(case.context_lens, case.seq_lens)):
        keys = case.keys[i].double().repeat_interleave(group, dim=1)  # [seq, h, d]
        values = case.values[i].double().repeat_interleave(group, dim=1)
        start = case.cu_seqlens_q[i]
        for t in range(case.query_lens[i]):
            q = case.query[start + t].double()  # [h, d]
            pos = ctx + t
            visible = [j for j in range(seq) if _visible(spec, pos, j)]
            scores = torch.einsum("hd,jhd->hj", q, keys[visible]) * spec.softmax_scale
            if spec.logits_soft_cap is not None:
                scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
            rows.append(torch.einsum("hj,jhd->hd", scores.softmax(-1), values[visible]))
    if not rows:
        return torch.zeros(0, spec.num_heads, spec.head_size, dtype=torch.float64)
    return torch.stack(rows)


def _visible(spec: AttentionSpec, query_pos: int, key_pos: int) -> bool:
    if spec.causal and key_pos > query_pos:
        return False
    window = spec.sliding_window
    return window is None or abs(query_pos - key_pos) < window


def _nan_caches(
    spec: AttentionSpec, num_blocks: int, packed: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    bs, kvh, d = spec.block_size, spec.num_kv_heads, spec.head_size
    if packed:  # vLLM 0.32's [blocks, kv_heads, block_size, 2 * head_size]
        cache = torch.full((num_blocks, kvh, bs, 2 * d), float("nan"), dtype=spec.dtype)
        key_cache, value_cache = cache.to(device).transpose(1, 2).split(d, dim=-1)
        return key_cache, value_cache
    shape = (num_blocks, bs, kvh, d)
    return (
        torch.full(shape, float("nan"), dtype=spec.dtype, device=device),
        torch.full(shape, float("nan"), dtype=spec.dtype, device=device),
    )


def run_case(
    case: Case,
    seed: int = 0,
    *,
    packed: bool = False,
    buffers: PlanBuffers | None = None,
    kv_in_cache: bool = False,
    provider: str | None = "reference",
    device_lengths: bool = False,
) -> tuple[torch.Tensor, PagedCase, AttentionPlan]:
    """plan + run over ``case``'s paged caches; ``out`` starts as a sentinel (-3).
    ``device_lengths``: the plan takes the lengths from ``lengths_on_device``."""
    paged = case.paged(np.random.default_rng(seed), packed=packed)
    device = case.query.device
    step = plan(
        case.cu_seqlens_q,
        case.seq_lens,
        paged.block_tables.to(device),
        paged.slot_mapping.to(device),
        case.num_decodes,
        case.spec,
        provider=provider,
        buffers=buffers,
        num_blocks=paged.num_blocks if device.type == "cpu" else None,
        device_lengths=lengths_on_device(case, device) if device_lengths else None,
    )
    key, value = case.new_kv()
    if kv_in_cache:  # the new K/V are already cached: write them here, run only attends
        slots = paged.slot_mapping[: case.num_tokens].to(device)
        bs = case.spec.block_size
        paged.key_cache[slots // bs, slots % bs] = key[: case.num_tokens]
        paged.value_cache[slots // bs, slots % bs] = value[: case.num_tokens]
        key = value = None
    out = torch.full_like(case.query, -3.0)
    run(case.query, key, value, paged.key_cache, paged.value_cache, step, out)
    return out, paged, step


def lengths_on_device(case: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A case's (``Case`` or ``MLACase``) ``(cu_seqlens_q, seq_lens)`` as int32 on
    ``device``, each one entry longer than the batch (as a model runner's persistent
    buffers are), the extra entry a value no request has."""
    return tuple(
        torch.tensor([*values, 1 << 30], dtype=torch.int32, device=device)
        for values in (case.cu_seqlens_q, case.seq_lens)
    )


def assert_close_to_oracle(case: Case, out: torch.Tensor) -> None:
    """Real rows match the float64 oracle within ``TOLERANCE``; padding rows untouched."""
    n = case.num_tokens
    expected = naive_attention(case)
    torch.testing.assert_close(
        out[:n].cpu().double(), expected.cpu(), **TOLERANCE[case.spec.dtype], check_dtype=False
    )
    assert (out[n:] == -3.0).all(), "padding rows of out must be left untouched"


def assert_cache_written(case: Case, paged: PagedCase) -> None:
    """Every new token's K/V sits at its slot; nothing was written elsewhere (still NaN)."""
    bs = case.spec.block_size
    key, value = case.new_kv()
    slots = paged.slot_mapping[: case.num_tokens]
    blocks, offsets = (slots // bs).to(key.device), (slots % bs).to(key.device)
    torch.testing.assert_close(paged.key_cache[blocks, offsets], key[: case.num_tokens])
    torch.testing.assert_close(paged.value_cache[blocks, offsets], value[: case.num_tokens])
    written = torch.zeros(paged.num_blocks, bs, dtype=torch.bool)
    block_tables = paged.block_tables.cpu()
    for i, seq in enumerate(case.seq_lens):
        pos = torch.arange(seq)
        written[block_tables[i, pos // bs], pos % bs] = True
    untouched = paged.key_cache.cpu()[~written]
    assert untouched.isnan().all(), "K/V written outside the requests' slots"
    assert paged.value_cache.cpu()[~written].isnan().all()
