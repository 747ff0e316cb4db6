"""The reference provider on CUDA tensors: the same cases as on CPU, plus no host sync in run."""

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

from npu_attention import AttentionSpec, BatchState, PlanBuffers, plan, run

pytestmark = pytest.mark.cuda

BATCHES = [  # (query_lens, context_lens, num_decodes, num_speculative_tokens, state)
    ([5, 17, 1, 33], [0, 0, 0, 0], 0, 0, BatchState.PREFILL_NO_CACHE),
    ([7, 20, 3], [16, 0, 45], 0, 0, BatchState.PREFILL_CACHE_HIT),
    ([1, 1, 1, 1, 1], [0, 15, 16, 70, 3], 5, 0, BatchState.DECODE_ONLY),
    ([3, 3, 3], [5, 31, 64], 3, 2, BatchState.SPEC_DECODING),
    ([1, 1, 1, 9, 24], [40, 2, 17, 30, 0], 3, 0, BatchState.CHUNKED_PREFILL),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("q", "ctx", "dec", "spec_tokens", "state"), BATCHES)
def test_states_on_cuda(dtype, q, ctx, dec, spec_tokens, state) -> None:
    spec = AttentionSpec(8, 2, 128, 16, dtype=dtype, num_speculative_tokens=spec_tokens,
                         sliding_window=40, logits_soft_cap=30.0)  # fmt: skip
    case = make_case(spec, q, ctx, dec, pad_tokens=3, device="cuda")
    out, paged, step = run_case(case, packed=True)
    assert step.state is state
    assert step.device.type == "cuda"
    assert_close_to_oracle(case, out)
    assert_cache_written(case, paged)


def test_decode_run_does_not_sync_on_cuda() -> None:
    spec = AttentionSpec(8, 2, 128, 16, dtype=torch.bfloat16)
    case = make_case(spec, [1] * 6, [30, 2, 0, 17, 90, 5], 6, pad_tokens=2, device="cuda")
    paged = case.paged(np.random.default_rng(0))
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables.cuda(),
                paged.slot_mapping.cuda(), 6, spec)  # fmt: skip
    key, value = case.new_kv()
    out = torch.full_like(case.query, -3.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(case.query, key, value, paged.key_cache, paged.value_cache, step, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close_to_oracle(case, out)


def test_fixed_buffers_on_cuda() -> None:
    spec = AttentionSpec(4, 2, 64, 16, dtype=torch.float16)
    buffers = PlanBuffers.allocate(8, 64, 8, device="cuda")
    pointer = buffers.slot_mapping.data_ptr()
    for seed, (q, ctx, dec) in enumerate([([1, 1, 1], [5, 60, 3], 3), ([1, 9, 30], [4, 0, 12], 1)]):
        case = make_case(spec, q, ctx, dec, seed=seed, pad_tokens=2, device="cuda")
        out, _, step = run_case(case, seed, buffers=buffers)
        assert step.slot_mapping.data_ptr() == pointer
        assert_close_to_oracle(case, out)
