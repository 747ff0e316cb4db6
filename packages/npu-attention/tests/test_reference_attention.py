"""plan + run with the reference provider against the dense float64 oracle.

Every case uses randomly permuted pages with block 0 reserved, NaN in unused
cache memory, and (where noted) padding tokens with slot -1. Tolerances per
dtype are ``npu_attention_cases.TOLERANCE``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from npu_attention_cases import (
    assert_cache_written,
    assert_close_to_oracle,
    make_case,
    run_case,
)

from npu_attention import AttentionSpec, BatchState, plan, run
from npu_attention.providers import reference

# (name, query_lens, context_lens, num_decodes, num_speculative_tokens, state)
BATCHES = [
    ("prefill_no_cache", [5, 17, 1, 33], [0, 0, 0, 0], 0, 0, BatchState.PREFILL_NO_CACHE),
    ("prefill_cache_hit", [7, 20, 3], [16, 0, 45], 0, 0, BatchState.PREFILL_CACHE_HIT),
    ("decode_only", [1, 1, 1, 1, 1], [0, 15, 16, 70, 3], 5, 0, BatchState.DECODE_ONLY),
    ("spec_decoding", [3, 3, 3], [5, 31, 64], 3, 2, BatchState.SPEC_DECODING),
    ("chunked_prefill", [1, 1, 1, 9, 24], [40, 2, 17, 30, 0], 3, 0, BatchState.CHUNKED_PREFILL),
    ("mixed_spec", [2, 2, 12, 5], [9, 33, 0, 21], 2, 1, BatchState.CHUNKED_PREFILL),
]


def _spec(**overrides: object) -> AttentionSpec:
    base = dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)
    base.update(overrides)
    return AttentionSpec(**base)


@pytest.mark.parametrize(("name", "q", "ctx", "dec", "spec_tokens", "state"), BATCHES)
def test_batch_states(name, q, ctx, dec, spec_tokens, state) -> None:
    case = make_case(_spec(num_speculative_tokens=spec_tokens), q, ctx, dec, pad_tokens=3)
    out, paged, step = run_case(case)
    assert step.state is state
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 112, 128, 160, 192, 224, 256])
def test_head_sizes(head_size: int) -> None:
    case = make_case(_spec(head_size=head_size), [1, 1, 6], [20, 3, 11], 2, pad_tokens=1)
    out, paged, _ = run_case(case)
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_dtypes_and_packed_cache_views(dtype: torch.dtype, packed: bool) -> None:
    case = make_case(_spec(dtype=dtype, head_size=128), [1, 1, 13, 4], [37, 0, 5, 50], 2)
    out, paged, _ = run_case(case, packed=packed)
    if packed:
        assert not paged.key_cache.is_contiguous()
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128])
def test_block_sizes(block_size: int) -> None:
    case = make_case(_spec(block_size=block_size), [1, 1, 10, 30], [130, 0, 129, 5], 2)
    out, paged, _ = run_case(case, seed=block_size)
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_head_grouping(heads: int, kv_heads: int) -> None:
    case = make_case(_spec(num_heads=heads, num_kv_heads=kv_heads), [1, 8, 3], [12, 0, 20], 1)
    out, paged, _ = run_case(case)
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


@pytest.mark.parametrize("window", [1, 4, 17, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_sliding_window(window: int, causal: bool) -> None:
    spec = _spec(sliding_window=window, causal=causal)
    case = make_case(spec, [1, 1, 19, 40], [50, 3, 25, 0], 2, pad_tokens=2)
    out, _, _ = run_case(case)
    assert_close_to_oracle(case, out)


@pytest.mark.parametrize("cap", [5.0, 30.0])
def test_logits_soft_cap(cap: float) -> None:
    case = make_case(_spec(logits_soft_cap=cap, scale=1.0), [1, 2, 15], [9, 20, 4], 1)
    out, _, _ = run_case(case)
    assert_close_to_oracle(case, out)


def test_soft_cap_window_and_spec_decode_together() -> None:
    spec = _spec(
        num_heads=8, num_kv_heads=2, logits_soft_cap=20.0, sliding_window=9,
        num_speculative_tokens=3, dtype=torch.bfloat16,
    )  # fmt: skip
    case = make_case(spec, [4, 4, 2, 11, 1], [30, 2, 14, 8, 0], 3, pad_tokens=4)
    out, paged, _ = run_case(case, packed=True)
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


def test_non_causal_with_cache() -> None:
    case = make_case(_spec(causal=False), [6, 3], [10, 0], 0)
    out, _, _ = run_case(case)
    assert_close_to_oracle(case, out)


def test_kv_already_in_cache() -> None:
    case = make_case(_spec(), [1, 1, 9], [14, 33, 6], 2, pad_tokens=2)
    out, paged, _ = run_case(case, kv_in_cache=True)
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


def test_zero_length_requests() -> None:
    case = make_case(_spec(), [1, 0, 7, 0], [5, 3, 0, 9], 1, pad_tokens=1)
    out, paged, _ = run_case(case)
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


@pytest.mark.parametrize(
    "overrides",
    [dict(causal=False), dict(causal=False, sliding_window=5), dict(causal=True)],
    ids=["encoder", "encoder_window", "causal_no_cache"],
)
def test_attention_without_cache(overrides: dict) -> None:
    case = make_case(_spec(**overrides), [4, 1, 19, 8], [0, 0, 0, 0], 0, pad_tokens=2)
    step = plan(case.cu_seqlens_q, case.seq_lens, None, None, 0, case.spec)
    key, value = case.new_kv()
    out = torch.full_like(case.query, -3.0)
    assert run(case.query, key, value, None, None, step, out) is out
    assert not step.has_cache
    assert_close_to_oracle(case, out)


@pytest.mark.parametrize("group_masks", [True, False], ids=["group_masks", "tile_masks"])
def test_tiles_split_under_memory_budget(
    monkeypatch: pytest.MonkeyPatch, group_masks: bool
) -> None:
    """Tiny budget: decodes split over several tiles, a long prefill over query-row chunks."""
    monkeypatch.setattr(reference, "TILE_ELEMENTS", 512)
    if not group_masks:
        monkeypatch.setattr(reference, "GROUP_MASK_ELEMENTS", 0)
    case = make_case(_spec(), [1, 1, 1, 1, 40, 3], [20, 50, 3, 9, 10, 0], 4, pad_tokens=1)
    out, paged, step = run_case(case)
    assert len(step.provider_data.tiles) > 4
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


def test_plan_with_tables_run_without_cache() -> None:
    """A prefill plan made with block tables also serves ``run`` without caches."""
    case = make_case(_spec(), [3, 11], [0, 0], 0, pad_tokens=1)
    paged = case.paged(np.random.default_rng(0))
    step = plan(
        case.cu_seqlens_q, case.seq_lens, paged.block_tables, paged.slot_mapping, 0, case.spec
    )
    key, value = case.new_kv()
    out = torch.full_like(case.query, -3.0)
    run(case.query, key, value, None, None, step, out)
    assert_close_to_oracle(case, out)


def test_qkv_as_views_of_one_projection() -> None:
    """vLLM passes query/key/value as column slices of the fused QKV output."""
    case = make_case(_spec(), [1, 1, 9], [30, 2, 5], 2, pad_tokens=2)
    paged = case.paged(np.random.default_rng(0))
    spec, tokens = case.spec, case.query.shape[0]
    key, value = case.new_kv()
    q_width, kv_width = spec.num_heads * spec.head_size, spec.num_kv_heads * spec.head_size
    qkv = torch.cat(
        [case.query.reshape(tokens, -1), key.reshape(tokens, -1), value.reshape(tokens, -1)], 1
    )
    query = qkv[:, :q_width].view(tokens, spec.num_heads, spec.head_size)
    key = qkv[:, q_width : q_width + kv_width].view(tokens, spec.num_kv_heads, spec.head_size)
    value = qkv[:, q_width + kv_width :].view(tokens, spec.num_kv_heads, spec.head_size)
    assert not query.is_contiguous()
    out_buffer = torch.full((tokens, spec.num_heads, 2 * spec.head_size), -3.0)
    out = out_buffer[:, :, : spec.head_size]  # a strided output view
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables, paged.slot_mapping, 2, spec)
    run(query, key, value, paged.key_cache, paged.value_cache, step, out)
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)
    assert (out_buffer[:, :, spec.head_size :] == -3.0).all()


def test_negative_slots_among_real_tokens_are_not_written() -> None:
    case = make_case(_spec(), [1, 6], [3, 0], 1)
    paged = case.paged(np.random.default_rng(0))
    slots = paged.slot_mapping.clone()
    skipped = [2, 5]
    slots[skipped] = -1
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables, slots, 1, case.spec)
    key, value = case.new_kv()
    out = torch.empty_like(case.query)
    run(case.query, key, value, paged.key_cache, paged.value_cache, step, out)
    bs = case.spec.block_size
    kept = slots[slots >= 0]
    torch.testing.assert_close(paged.key_cache[kept // bs, kept % bs], key[slots >= 0])
    torch.testing.assert_close(paged.value_cache[kept // bs, kept % bs], value[slots >= 0])
    dropped = paged.slot_mapping[skipped]
    assert paged.key_cache[dropped // bs, dropped % bs].isnan().all()
    assert paged.value_cache[dropped // bs, dropped % bs].isnan().all()
