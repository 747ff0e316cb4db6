"""Random batches (hypothesis) through plan + run against the float64 oracle."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from npu_attention_cases import (
    assert_cache_written,
    assert_close_to_oracle,
    make_case,
    run_case,
)

from npu_attention import AttentionSpec, plan, run


@st.composite
def specs(draw: st.DrawFn) -> AttentionSpec:
    kv_heads = draw(st.sampled_from([1, 2]))
    return AttentionSpec(
        num_heads=kv_heads * draw(st.sampled_from([1, 2, 3])),
        num_kv_heads=kv_heads,
        head_size=draw(st.sampled_from([64, 80, 96, 128, 192, 256])),
        block_size=draw(st.sampled_from([16, 32, 64])),
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        causal=draw(st.booleans() | st.just(True)),
        sliding_window=draw(st.none() | st.integers(1, 40)),
        logits_soft_cap=draw(st.none() | st.floats(5.0, 50.0)),
        num_speculative_tokens=draw(st.integers(0, 3)),
    )


@st.composite
def batches(draw: st.DrawFn):
    spec = draw(specs())
    num_decodes = draw(st.integers(0, 4))
    num_prefills = draw(st.integers(0 if num_decodes else 1, 3))
    decode_len = st.integers(1, 1 + spec.num_speculative_tokens)
    query_lens = [draw(decode_len) for _ in range(num_decodes)]
    query_lens += [draw(st.integers(1, 40)) for _ in range(num_prefills)]
    context_lens = [draw(st.integers(0, 70)) for _ in query_lens]
    return spec, query_lens, context_lens, num_decodes, draw(st.integers(0, 3))


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(batch=batches(), packed=st.booleans(), seed=st.integers(0, 2**16))
def test_random_batches(batch, packed: bool, seed: int) -> None:
    spec, query_lens, context_lens, num_decodes, pad_tokens = batch
    case = make_case(spec, query_lens, context_lens, num_decodes, seed=seed, pad_tokens=pad_tokens)
    out, paged, _ = run_case(case, seed, packed=packed)
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    spec=specs(),
    query_lens=st.lists(st.integers(0, 30), min_size=1, max_size=4),
    pad_tokens=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_random_batches_without_cache(spec, query_lens, pad_tokens: int, seed: int) -> None:
    case = make_case(spec, query_lens, [0] * len(query_lens), 0, seed=seed, pad_tokens=pad_tokens)
    step = plan(case.cu_seqlens_q, case.seq_lens, None, None, 0, spec)
    key, value = case.new_kv()
    out = torch.full_like(case.query, -3.0)
    run(case.query, key, value, None, None, step, out)
    assert_close_to_oracle(case, out)
