"""The reference MLA provider against the float64 MLA oracle, for every batch state.

Tolerances (absolute and relative, outputs O(1)): float32 3e-5, float16 3e-3,
bfloat16 2e-2 (``mla_cases.MLA_TOLERANCE``); inputs are rounded to the dtype
before the oracle sees them.
"""

from __future__ import annotations

import pytest
import torch
from mla_cases import (
    MLA_TOLERANCE,
    SMALL_SPEC,
    assert_latents_written,
    assert_mla_matches_oracle,
    decompressed,
    make_mla_case,
    run_mla_case,
)

from npu_attention import BatchState, PlanBuffers
from npu_attention.mla import MLASpec

# name: (query_lens, context_lens, num_decodes, num_speculative_tokens, state)
STATES = {
    "prefill_no_cache": ([5, 19, 1], [0, 0, 0], 0, 0, BatchState.PREFILL_NO_CACHE),
    "prefill_cache_hit": ([7, 3], [21, 40], 0, 0, BatchState.PREFILL_CACHE_HIT),
    "chunked_prefill": ([1, 1, 6, 9], [30, 4, 17, 0], 2, 0, BatchState.CHUNKED_PREFILL),
    "decode_only": ([1, 1, 1], [0, 33, 15], 3, 0, BatchState.DECODE_ONLY),
    "spec_decoding": ([3, 3, 2], [12, 40, 5], 3, 2, BatchState.SPEC_DECODING),
    "spec_chunked": ([3, 2, 11], [9, 20, 6], 2, 2, BatchState.CHUNKED_PREFILL),
}


def _spec(dtype: torch.dtype = torch.float32, **overrides) -> MLASpec:
    return MLASpec(**{**SMALL_SPEC, "block_size": 16, "dtype": dtype, **overrides})


@pytest.mark.parametrize("name", STATES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_states_match_oracle(name: str, dtype: torch.dtype) -> None:
    query_lens, context_lens, num_decodes, spec_tokens, state = STATES[name]
    spec = _spec(dtype, num_speculative_tokens=spec_tokens)
    case = make_mla_case(spec, query_lens, context_lens, num_decodes, pad_tokens=2)
    decode_out, prefill_out, paged, step = run_mla_case(case)
    assert step.state == state
    assert_mla_matches_oracle(case, decode_out, prefill_out)
    assert_latents_written(case, paged)


@pytest.mark.parametrize("name", ["chunked_prefill", "spec_decoding"])
def test_vllm_interleaved_cache_views(name: str) -> None:
    query_lens, context_lens, num_decodes, spec_tokens, _ = STATES[name]
    spec = _spec(num_speculative_tokens=spec_tokens)
    case = make_mla_case(spec, query_lens, context_lens, num_decodes, pad_tokens=1, seed=3)
    decode_out, prefill_out, paged, _ = run_mla_case(case, layout="interleaved")
    assert not paged.cache.kv_c.is_contiguous()
    assert_mla_matches_oracle(case, decode_out, prefill_out)
    assert_latents_written(case, paged)


@pytest.mark.parametrize(
    "dims",
    [
        dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        dict(num_heads=3, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=40),
    ],
    ids=["deepseek_v3", "odd_widths"],
)
def test_widths(dims: dict) -> None:
    spec = _spec(torch.bfloat16, **dims)
    case = make_mla_case(spec, [1, 1, 12], [20, 0, 9], 2, seed=5)
    decode_out, prefill_out, _, _ = run_mla_case(case)
    assert_mla_matches_oracle(case, decode_out, prefill_out)


def test_block_size_and_fixed_buffers() -> None:
    spec = _spec(block_size=32, num_speculative_tokens=1)
    buffers = PlanBuffers.allocate(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=8)
    for seed, lens in enumerate([([2, 2, 5], [40, 7, 30], 2), ([1, 2], [70, 3], 2)]):
        case = make_mla_case(spec, *lens, seed=seed, pad_tokens=3)
        decode_out, prefill_out, _, step = run_mla_case(case, buffers=buffers)
        assert step.block_tables.data_ptr() == buffers.block_tables.data_ptr()
        assert_mla_matches_oracle(case, decode_out, prefill_out)


def test_absorbed_decode_equals_decompressed_attention() -> None:
    """What a caller gets from mla_decode after the W_UV up-projection is the
    decompressed attention of the same query: the contract vLLM's MLA layer uses."""
    spec = _spec(num_speculative_tokens=1)
    case = make_mla_case(spec, [2, 1], [13, 30], 2, seed=7)
    n, p, v = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim
    w = case.kv_b_weight.view(n, p + v, spec.kv_lora_rank)
    w_uk, w_uv = w[:, :p], w[:, p:]  # [N, P, L], [N, V, L]
    q_nope = torch.randn(case.num_decode_tokens, n, p, generator=torch.Generator().manual_seed(1))
    case.q_latent = torch.einsum("tnp,npl->tnl", q_nope, w_uk)
    decode_out, _, _, _ = run_mla_case(case)
    absorbed = torch.einsum("tnl,nvl->tnv", decode_out.double(), w_uv.double())
    expected = []
    for i, t in ((0, 0), (0, 1), (1, 0)):
        keys, values = decompressed(case, i)
        keys = torch.cat([keys[:, :, :p], keys[:, :, p:]], -1)
        row = case.cu_seqlens_q[i] + t
        q = torch.cat([q_nope[row], case.q_rope[row]], -1).double()
        visible = case.context_lens[i] + t + 1
        # the oracle's keys/values are rounded through the dtype; unrounded here (float32)
        scores = torch.einsum("nd,snd->ns", q, keys[:visible]) * spec.softmax_scale
        expected.append(torch.einsum("ns,snd->nd", scores.softmax(-1), values[:visible]))
    torch.testing.assert_close(absorbed, torch.stack(expected), **MLA_TOLERANCE[torch.float32])
