"""The ``triton`` MLA provider against the float64 MLA oracle.

Unmarked cases are small and run on the CPU through Triton's interpreter when no
GPU is present; cases marked ``cuda`` use DeepSeek-V3's widths on a GPU, and one
replays the decode from a CUDA graph after the plan's fixed buffers change.
Tolerances: ``mla_cases.MLA_TOLERANCE`` (float32 3e-5, float16 3e-3, bfloat16 2e-2).
Triton's interpreter (3.9) computes bfloat16 dots wrongly (a bfloat16 ``tl.dot`` after
a cast gave errors of 1e10 in a 16x16 check), so its half-precision case is float16.
"""

from __future__ import annotations

import pytest
import torch
from mla_cases import (
    SMALL_SPEC,
    assert_decode_graph_replays,
    assert_latents_written,
    assert_mla_matches_oracle,
    make_mla_case,
    run_mla_case,
)
from triton_interpreter import DEVICE, HAS_CUDA

from npu_attention import get_provider
from npu_attention.mla import MLASpec

pytest.importorskip("triton")

# name: (query_lens, context_lens, num_decodes, num_speculative_tokens)
SMALL_CASES = {
    "decode_only": ([1, 1, 1], [0, 37, 20], 3, 0),
    "spec_decoding": ([3, 3, 2], [12, 40, 5], 3, 2),
    "chunked_prefill": ([1, 1, 6, 9], [30, 4, 17, 0], 2, 0),
    "spec_chunked": ([3, 1, 11], [9, 20, 6], 2, 2),
}


@pytest.fixture
def triton_mla():
    """The registry's triton MLA provider, its tunables restored afterwards."""
    provider = get_provider("triton", DEVICE, family="mla")
    saved = dict(vars(provider))
    yield provider
    vars(provider).update(saved)


def _spec(dtype=torch.float32, **overrides) -> MLASpec:
    return MLASpec(**{**SMALL_SPEC, "block_size": 16, "dtype": dtype, **overrides})


@pytest.mark.parametrize("name", SMALL_CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_small_states_match_oracle(name: str, splits: int, triton_mla) -> None:
    query_lens, context_lens, num_decodes, spec_tokens = SMALL_CASES[name]
    triton_mla.fixed_kv_splits = splits
    spec = _spec(num_speculative_tokens=spec_tokens)
    case = make_mla_case(spec, query_lens, context_lens, num_decodes, pad_tokens=2, device=DEVICE)
    decode_out, prefill_out, paged, step = run_mla_case(case, provider="triton")
    assert step.provider_data.num_kv_splits == splits
    assert_mla_matches_oracle(case, decode_out, prefill_out)
    assert_latents_written(case, paged)


@pytest.mark.parametrize("name", SMALL_CASES)
def test_lengths_given_on_the_device(name: str) -> None:
    query_lens, context_lens, num_decodes, spec_tokens = SMALL_CASES[name]
    spec = _spec(num_speculative_tokens=spec_tokens)
    case = make_mla_case(spec, query_lens, context_lens, num_decodes, pad_tokens=2, device=DEVICE)
    decode_out, prefill_out, paged, _ = run_mla_case(case, provider="triton", device_lengths=True)
    assert_mla_matches_oracle(case, decode_out, prefill_out)
    assert_latents_written(case, paged)


@pytest.mark.parametrize("layout", ["planes", "interleaved"])
def test_odd_widths_half_precision_and_cache_layouts(layout: str, triton_mla) -> None:
    triton_mla.min_tokens_per_split, triton_mla.target_waves = 16, 10**4  # 4 splits: 50 // 16
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    spec = _spec(dtype, num_heads=3, kv_lora_rank=48, qk_rope_head_dim=8, num_speculative_tokens=1)
    case = make_mla_case(spec, [2, 1, 2], [50, 3, 17], 3, pad_tokens=1, seed=4, device=DEVICE)
    decode_out, prefill_out, paged, _ = run_mla_case(case, provider="triton", layout=layout)
    assert_mla_matches_oracle(case, decode_out, prefill_out)
    assert_latents_written(case, paged)


@pytest.mark.parametrize("context", [False, True])
def test_prefill_values_narrower_than_keys(context: bool) -> None:
    """MLA's prefill shape at small widths: 24-wide queries and keys (16 + 8 rope), 16-wide
    values, through the portable kernel; prefills alone (no cached context) and after
    a cached prefix, beside decodes."""
    spec = _spec(v_head_dim=16)
    if context:
        case = make_mla_case(spec, [1, 7, 20], [9, 5, 33], 1, pad_tokens=2, device=DEVICE)
    else:
        case = make_mla_case(spec, [5, 17, 1], [0, 0, 0], 0, pad_tokens=2, device=DEVICE)
    decode_out, prefill_out, _, step = run_mla_case(case, provider="triton")
    assert (step.provider_data.prefill.token_blocks is None) == context
    assert_mla_matches_oracle(case, decode_out, prefill_out)


def _deepseek_spec(num_heads: int, block_size: int, spec_tokens: int = 0) -> MLASpec:
    return MLASpec(
        num_heads=num_heads,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        block_size=block_size,
        dtype=torch.bfloat16,
        num_speculative_tokens=spec_tokens,
    )


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("hopper", [True, False])
def test_gpu_prefill_deepseek_widths(num_heads: int, block_size: int, hopper: bool, triton_mla):
    """The MHA prefill at DeepSeek-V3's widths (192-wide queries and keys, 128-wide
    values) without cached context, requests across tile edges (1, 63, 64, 65, 128,
    129, 300 tokens; unused cache slots NaN): through the Gluon prefill on a Hopper GPU
    (``hopper``, checked that it ran there) and through the portable kernel."""
    from npu_attention.providers.triton import gluon_kernels

    triton_mla.hopper_prefill = hopper
    kernels = gluon_kernels(torch.device("cuda"), "hopper_prefill")
    if hopper and kernels is None:
        pytest.skip("needs a Hopper GPU and a Triton whose Gluon the kernels ran on")
    calls = []
    if kernels is not None:
        original = kernels.hopper_prefill
        kernels.hopper_prefill = lambda *a, **k: calls.append(1) or original(*a, **k)
    query_lens = [1, 63, 64, 65, 128, 129, 300]
    spec = _deepseek_spec(num_heads, block_size)
    case = make_mla_case(spec, query_lens, [0] * 7, 0, pad_tokens=3, device="cuda")
    try:
        decode_out, prefill_out, _, _ = run_mla_case(case, provider="triton")
    finally:
        if kernels is not None:
            kernels.hopper_prefill = original
    assert len(calls) == int(hopper)
    assert_mla_matches_oracle(case, decode_out, prefill_out)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_heads", [16, 32, 64, 128])  # 128 / TP of 1, 2, 4 and 8 ranks
@pytest.mark.parametrize("spec_tokens", [0, 1, 3])
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_deepseek_widths(num_heads: int, spec_tokens: int, block_size: int) -> None:
    """Every head tile the provider picks (16, 32 or 64 heads a program, rows of heads x
    tokens 16 to 64, 4 or 8 warps) at DeepSeek-V3's widths."""
    spec = _deepseek_spec(num_heads, block_size, spec_tokens)
    q = 1 + spec_tokens
    case = make_mla_case(
        spec, [q] * 5 + [40], [0, 7, 300, 1100, 64, 90], 5, pad_tokens=3, device="cuda"
    )
    decode_out, prefill_out, paged, _ = run_mla_case(case, provider="triton")
    assert_mla_matches_oracle(case, decode_out, prefill_out)
    assert_latents_written(case, paged)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_graph_replay_reads_the_refreshed_plan() -> None:
    """Decode captured once with fixed buffers, replayed for a second step with other
    lengths and pages: each replay matches the oracle of its own step."""
    assert_decode_graph_replays(
        _spec(torch.bfloat16, num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64)
    )
