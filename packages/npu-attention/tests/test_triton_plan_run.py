"""``plan`` + ``run`` with ``provider="triton"`` against the shared dense float64 oracle.

The same batches as the reference provider's tests, through the public API:
permuted pages with block 0 reserved, NaN in unused cache memory, padding slots,
fixed-buffer mode. Without a GPU they run under Triton's interpreter. Tolerances
per dtype are ``npu_attention_cases.TOLERANCE``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from npu_attention_cases import (
    assert_cache_written,
    assert_close_to_oracle,
    lengths_on_device,
    make_case,
    run_case,
)
from triton_interpreter import DEVICE, HAS_CUDA

from npu_attention import AttentionSpec, BatchState, PlanBuffers, plan, run

pytest.importorskip("triton")

# (query_lens, context_lens, num_decodes, num_speculative_tokens, state)
BATCHES = {
    "prefill_no_cache": ([5, 17, 1, 33], [0, 0, 0, 0], 0, 0, BatchState.PREFILL_NO_CACHE),
    "prefill_cache_hit": ([7, 20, 3], [16, 0, 45], 0, 0, BatchState.PREFILL_CACHE_HIT),
    "decode_only": ([1, 1, 1, 1, 1], [0, 15, 16, 70, 3], 5, 0, BatchState.DECODE_ONLY),
    "spec_decoding": ([3, 3, 3], [5, 31, 64], 3, 2, BatchState.SPEC_DECODING),
    "chunked_prefill": ([1, 1, 1, 9, 24], [40, 2, 17, 30, 0], 3, 0, BatchState.CHUNKED_PREFILL),
    "mixed_spec": ([2, 2, 12, 5], [9, 33, 0, 21], 2, 1, BatchState.CHUNKED_PREFILL),
    "zero_length_requests": ([1, 0, 7, 0], [5, 3, 0, 9], 1, 0, BatchState.CHUNKED_PREFILL),
}


def _spec(**overrides: object) -> AttentionSpec:
    base = dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    base["dtype"] = torch.bfloat16 if HAS_CUDA else torch.float32
    base.update(overrides)
    return AttentionSpec(**base)


@pytest.mark.parametrize("name", list(BATCHES))
def test_batch_states_through_plan_and_run(name: str) -> None:
    query_lens, context_lens, num_decodes, spec_tokens, state = BATCHES[name]
    spec = _spec(num_speculative_tokens=spec_tokens)
    case = make_case(spec, query_lens, context_lens, num_decodes, pad_tokens=3, device=DEVICE)
    out, paged, step = run_case(case, provider="triton")
    assert step.state is state
    assert type(step.provider).__name__ == "TritonProvider"
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


@pytest.mark.parametrize(
    "name", ["prefill_cache_hit", "decode_only", "spec_decoding", "chunked_prefill"]
)
def test_lengths_given_on_the_device(name: str) -> None:
    """The kernels read the caller's device lengths (cut to the batch) as they read
    the plan's own upload."""
    query_lens, context_lens, num_decodes, spec_tokens, state = BATCHES[name]
    spec = _spec(num_speculative_tokens=spec_tokens)
    case = make_case(spec, query_lens, context_lens, num_decodes, pad_tokens=2, device=DEVICE)
    out, paged, step = run_case(case, provider="triton", device_lengths=True)
    assert step.state is state and step.seq_lens.shape == (len(query_lens),)
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


def test_fixed_buffer_mode_and_packed_caches() -> None:
    buffers = PlanBuffers.allocate(8, 64, 16, device=DEVICE)
    for seed, (query_lens, context_lens, num_decodes) in enumerate(
        [([1, 1, 6], [20, 3, 11], 2), ([1, 1, 1, 1], [50, 0, 7, 100], 4)]
    ):
        case = make_case(_spec(), query_lens, context_lens, num_decodes, seed=seed, device=DEVICE)
        out, paged, step = run_case(case, seed, packed=True, buffers=buffers, provider="triton")
        assert step.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()
        assert_close_to_oracle(case, out)
        assert_cache_written(case, paged)


@pytest.mark.parametrize(
    "overrides",
    [dict(causal=False), dict(causal=False, sliding_window=5), dict(causal=True)],
    ids=["encoder", "encoder_window", "causal_no_cache"],
)
def test_attention_without_cache(overrides: dict) -> None:
    case = make_case(_spec(**overrides), [6, 9, 1], [0, 0, 0], 0, device=DEVICE)
    step = plan(case.cu_seqlens_q, case.seq_lens, None, None, 0, case.spec, provider="triton",
                device=DEVICE)  # fmt: skip
    key, value = case.new_kv()
    out = torch.full_like(case.query, -3.0)
    run(case.query, key, value, None, None, step, out)
    assert_close_to_oracle(case, out)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(BATCHES))
def test_no_host_sync_on_gpu(name: str) -> None:
    """run (write_kv + attend) issues nothing that synchronizes with the host."""
    query_lens, context_lens, num_decodes, spec_tokens, _ = BATCHES[name]
    spec = _spec(num_speculative_tokens=spec_tokens, num_heads=32, num_kv_heads=8, head_size=128)
    case = make_case(spec, query_lens, context_lens, num_decodes, pad_tokens=1, device="cuda")
    run_case(case, provider="triton")  # compile the kernels first
    paged = case.paged(np.random.default_rng(1))
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables.cuda(),
                paged.slot_mapping.cuda(), case.num_decodes, case.spec, provider="triton")  # fmt: skip
    key, value = case.new_kv()
    out = torch.full_like(case.query, -3.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(case.query, key, value, paged.key_cache, paged.value_cache, step, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close_to_oracle(case, out)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["decode_only", "spec_decoding", "chunked_prefill"])
def test_plan_with_device_lengths_does_not_sync_on_gpu(name: str) -> None:
    """With the lengths already on the GPU, plan and run issue nothing that waits."""
    query_lens, context_lens, num_decodes, spec_tokens, _ = BATCHES[name]
    spec = _spec(num_speculative_tokens=spec_tokens, num_heads=32, num_kv_heads=8, head_size=128)
    case = make_case(spec, query_lens, context_lens, num_decodes, pad_tokens=1, device="cuda")
    run_case(case, provider="triton", device_lengths=True)  # compile the kernels first
    paged = case.paged(np.random.default_rng(1))
    tables, slots = paged.block_tables.cuda(), paged.slot_mapping.cuda()
    lengths = lengths_on_device(case, torch.device("cuda"))
    key, value = case.new_kv()
    out = torch.full_like(case.query, -3.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = plan(case.cu_seqlens_q, case.seq_lens, tables, slots, case.num_decodes,
                    case.spec, provider="triton", device_lengths=lengths)  # fmt: skip
        run(case.query, key, value, paged.key_cache, paged.value_cache, step, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.seq_lens.data_ptr() == lengths[1].data_ptr()
    assert_close_to_oracle(case, out)


def test_qkv_views_of_one_projection_and_strided_output() -> None:
    """vLLM passes query/key/value as column slices of the fused QKV output."""
    case = make_case(_spec(), [1, 1, 9], [30, 2, 5], 2, pad_tokens=2, device=DEVICE)
    paged = case.paged(np.random.default_rng(0))
    spec, tokens = case.spec, case.query.shape[0]
    key, value = case.new_kv()
    q_width, kv_width = spec.num_heads * spec.head_size, spec.num_kv_heads * spec.head_size
    qkv = torch.cat([t.reshape(tokens, -1) for t in (case.query, key, value)], 1)
    query = qkv[:, :q_width].view(tokens, spec.num_heads, spec.head_size)
    key = qkv[:, q_width : q_width + kv_width].view(tokens, spec.num_kv_heads, spec.head_size)
    value = qkv[:, q_width + kv_width :].view(tokens, spec.num_kv_heads, spec.head_size)
    out_buffer = torch.full(
        (tokens, spec.num_heads, 2 * spec.head_size), -3.0, dtype=spec.dtype, device=DEVICE
    )
    out = out_buffer[:, :, : spec.head_size]
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables.to(DEVICE),
                paged.slot_mapping.to(DEVICE), 2, spec, provider="triton")  # fmt: skip
    run(query, key, value, paged.key_cache, paged.value_cache, step, out)
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)
    assert (out_buffer[:, :, spec.head_size :] == -3.0).all()
