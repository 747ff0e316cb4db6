"""Quantized KV caches (fp8 per tensor, int8 / fp8 per token and head) on the reference
provider: every batch state against a float64 oracle on the dequantized cache, the
rows written as vLLM defines each kind, the quantization error against the
unquantized cache, and bad input refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_quant_cases import (
    QUANTIZED_KINDS,
    assert_rows_written,
    oracle,
    quantized_paged,
    run_quantized,
)
from npu_attention_cases import TOLERANCE, make_case, naive_attention

from npu_attention import AttentionSpec, BatchState, kv_quant, plan, run
from npu_attention.kv_quant import ScaleKind

BATCHES = [  # (query_lens, context_lens, num_decodes, num_speculative_tokens, state)
    ([5, 17, 1], [0, 0, 0], 0, 0, BatchState.PREFILL_NO_CACHE),
    ([7, 20, 3], [16, 0, 31], 0, 0, BatchState.PREFILL_CACHE_HIT),
    ([1, 1, 1, 1], [15, 16, 17, 40], 4, 0, BatchState.DECODE_ONLY),
    ([3, 3], [31, 32], 2, 2, BatchState.SPEC_DECODING),
    ([1, 1, 9, 24], [47, 2, 16, 0], 2, 0, BatchState.CHUNKED_PREFILL),
]

# Bounds on the largest |out - oracle on the unquantized cache| of the case of
# test_quantization_error_against_the_unquantized_cache (unit-variance K/V and queries,
# bfloat16 output): what each kind costs before any kernel error. Measured: fp8 /
# fp8_e4m3 (calibrated scale) 0.073 max, 0.0060 mean; int8_per_token_head 0.015 / 0.0015;
# fp8_per_token_head 0.071 / 0.0059; auto 0.0039 / 0.00024 (bfloat16 rounding alone).
QUANTIZATION_ERROR = {
    "fp8": 0.1,
    "fp8_e4m3": 0.1,
    "int8_per_token_head": 0.025,
    "fp8_per_token_head": 0.1,
}


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
@pytest.mark.parametrize(("q", "ctx", "dec", "spec_tokens", "state"), BATCHES)
def test_batch_states_against_the_dequantized_cache(kind, q, ctx, dec, spec_tokens, state):
    spec = AttentionSpec(8, 2, 64, 16, dtype=torch.bfloat16, kv_cache_dtype=kind,
                         num_speculative_tokens=spec_tokens)  # fmt: skip
    case = make_case(spec, q, ctx, dec, pad_tokens=2)
    out, quant, step = run_quantized(case)
    assert step.state is state
    expected = oracle(case, quant, state)
    n = case.num_tokens
    torch.testing.assert_close(out[:n].double(), expected, **TOLERANCE[spec.dtype])
    assert (out[n:] == -3.0).all()
    assert_rows_written(case, quant)


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_head_sizes_and_dtypes_at_page_edges(kind, head_size, dtype):
    """Contexts that end one before, at and one past a page boundary, decode and prefill."""
    spec = AttentionSpec(4, 2, head_size, 16, dtype=dtype, kv_cache_dtype=kind)
    case = make_case(spec, [1, 1, 1, 16, 17], [15, 16, 31, 32, 16], 3, seed=head_size)
    out, quant, step = run_quantized(case, seed=1)
    assert step.state is BatchState.CHUNKED_PREFILL
    expected = oracle(case, quant, step.state)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])
    assert_rows_written(case, quant)


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_sliding_window_soft_cap_and_packed_strides(kind):
    spec = AttentionSpec(6, 2, 128, 32, dtype=torch.float16, kv_cache_dtype=kind,
                         sliding_window=20, logits_soft_cap=30.0)  # fmt: skip
    case = make_case(spec, [1, 1, 12], [70, 5, 33], 2)
    out, quant, step = run_quantized(case)
    torch.testing.assert_close(
        out.double(), oracle(case, quant, step.state), **TOLERANCE[spec.dtype]
    )


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_quantization_error_against_the_unquantized_cache(kind):
    """The error the kind itself brings: the quantized run against the oracle on the
    unquantized keys and values, within ``QUANTIZATION_ERROR[kind]``, and well above
    zero (the pages do hold 8-bit codes)."""
    spec = AttentionSpec(8, 2, 128, 16, dtype=torch.bfloat16, kv_cache_dtype=kind)
    case = make_case(spec, [1] * 6 + [30], [200, 17, 64, 99, 130, 5, 40], 6, seed=7)
    out, _, _ = run_quantized(case)
    error = (out.double() - naive_attention(case)).abs().max().item()
    assert 1e-3 < error < QUANTIZATION_ERROR[kind], error


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_next_step_reads_what_this_step_wrote(kind):
    """A prefill writes its rows; the following decode of the same requests (the pages
    as left by ``run``) equals the oracle on the dequantized rows of both steps."""
    spec = AttentionSpec(4, 1, 64, 16, dtype=torch.bfloat16, kv_cache_dtype=kind)
    full = make_case(spec, [1, 1], [20, 33], 2, seed=3)
    first = make_case(spec, [20, 33], [0, 0], 0, seed=3)
    first.keys = [k[:-1] for k in full.keys]
    first.values = [v[:-1] for v in full.values]
    first.query = torch.randn(53, 4, 64).to(spec.dtype)
    _, quant, _ = run_quantized(first)
    paged = quant.paged
    bs = spec.block_size
    slots = [int(paged.block_tables[i, s // bs]) * bs + s % bs for i, s in enumerate([20, 33])]
    step = plan(full.cu_seqlens_q, full.seq_lens, paged.block_tables, slots, 2, spec)
    key, value = full.new_kv()
    out = torch.empty_like(full.query)
    run(full.query, key, value, paged.key_cache, paged.value_cache, step, out,
        k_scale=quant.k_scale, v_scale=quant.v_scale)  # fmt: skip
    torch.testing.assert_close(
        out.double(), oracle(full, quant, step.state), **TOLERANCE[spec.dtype]
    )


def test_definitions_follow_vllm():
    """Per token and head: scale = max(absmax / 127, 1e-6), half away from zero;
    fp8: saturated at 448; per tensor: x / scale, saturated."""
    rows = torch.tensor([[[1.27, -0.635, 0.0, 0.004]], [[0.0, 0.0, 0.0, 0.0]]])
    codes, scales = kv_quant.quantize_per_token_head(rows, torch.int8)
    assert codes.dtype == torch.int8
    assert codes[0, 0].tolist() == [127, -64, 0, 0]  # -63.5 rounds away from zero
    torch.testing.assert_close(scales, torch.tensor([[0.01], [1e-6]]))
    fp8, fp8_scales = kv_quant.quantize_per_token_head(rows, torch.float8_e4m3fn)
    assert fp8.dtype == torch.float8_e4m3fn and fp8[0, 0, 0].float() == 448.0
    torch.testing.assert_close(fp8_scales, torch.tensor([[1.27 / 448], [1e-6]]))
    saturated = kv_quant.quantize_per_tensor(torch.tensor([1000.0, -5.0]), torch.tensor(2.0))
    assert saturated.float().tolist() == [448.0, -2.5]


def test_spec_carries_the_cache_dtype_and_its_scales():
    base = dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    expected = {
        "auto": (torch.bfloat16, ScaleKind.NONE),
        "fp8": (torch.float8_e4m3fn, ScaleKind.PER_TENSOR),
        "fp8_e4m3": (torch.float8_e4m3fn, ScaleKind.PER_TENSOR),
        "int8_per_token_head": (torch.int8, ScaleKind.PER_TOKEN_HEAD),
        "fp8_per_token_head": (torch.float8_e4m3fn, ScaleKind.PER_TOKEN_HEAD),
    }
    for kind, (dtype, scales) in expected.items():
        spec = AttentionSpec(**base, dtype=torch.bfloat16, kv_cache_dtype=kind)
        assert (spec.cache_dtype, spec.kv_scales) == (dtype, scales)


# ---------------------------------------------------------------- bad input


def test_unsupported_kind_names_the_supported_ones():
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8'.*got 'fp8_e5m2'"
    ):
        AttentionSpec(4, 2, 64, 16, kv_cache_dtype="fp8_e5m2")


def _bad_run(kind: str, **scales):
    """A quantized (or auto) decode whose run gets ``scales``; the caches before and after."""
    spec = AttentionSpec(4, 2, 64, 16, dtype=torch.bfloat16, kv_cache_dtype=kind)
    case = make_case(spec, [1, 1], [5, 20], 2)
    quant = quantized_paged(case)
    paged = quant.paged
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables, paged.slot_mapping, 2, spec)
    key, value = case.new_kv()
    before = (paged.key_cache.clone(), paged.value_cache.clone())
    given = {"k_scale": quant.k_scale, "v_scale": quant.v_scale, **scales}
    if kind == "auto":
        given = scales
    out = torch.full_like(case.query, -3.0)
    return lambda: run(case.query, key, value, paged.key_cache, paged.value_cache, step, out,
                       **given), before, paged, out  # fmt: skip


def _assert_nothing_written(before, paged, out):
    assert torch.equal(before[0].view(torch.uint8), paged.key_cache.view(torch.uint8))
    assert torch.equal(before[1].view(torch.uint8), paged.value_cache.view(torch.uint8))
    assert (out == -3.0).all()


@pytest.mark.parametrize(
    ("kind", "scales", "message"),
    [
        ("fp8", {"k_scale": torch.ones(2)}, r"k_scale of kv_cache_dtype='fp8' must have one element, got shape \[2\]"),
        ("fp8", {"v_scale": None}, r"kv_cache_dtype='fp8' needs v_scale: float32 with one element, got None"),
        ("int8_per_token_head", {"k_scale": torch.ones(1)},
         r"k_scale of kv_cache_dtype='int8_per_token_head' must have shape \[num_blocks, block_size, num_kv_heads\] = \[\d+, 16, 2\], got shape \[1\]"),
        ("fp8_per_token_head", {"v_scale": torch.ones(3, 16, 2)},
         r"v_scale .* must have shape \[num_blocks, block_size, num_kv_heads\] = \[\d+, 16, 2\], got shape \[3, 16, 2\]"),
        ("auto", {"k_scale": torch.ones(1)}, r"kv_cache_dtype='auto' takes no scales, got k_scale of shape \[1\]"),
    ],
)  # fmt: skip
def test_bad_scales_name_expected_and_received_and_write_nothing(kind, scales, message):
    call, before, paged, out = _bad_run(kind, **scales)
    with pytest.raises(ValueError, match=message):
        call()
    _assert_nothing_written(before, paged, out)


def test_scale_of_the_wrong_dtype_is_a_type_error():
    call, before, paged, out = _bad_run("fp8", k_scale=torch.ones(1, dtype=torch.float16))
    with pytest.raises(
        TypeError, match=r"k_scale must have dtype torch.float32, got torch.float16"
    ):
        call()
    _assert_nothing_written(before, paged, out)


def test_caches_of_the_model_dtype_under_a_quantized_kind_are_refused():
    spec = AttentionSpec(4, 2, 64, 16, dtype=torch.bfloat16, kv_cache_dtype="int8_per_token_head")
    case = make_case(spec, [1], [5], 1)
    paged = case.paged(np.random.default_rng(0))
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables, paged.slot_mapping, 1, spec)
    key, value = case.new_kv()
    scale = torch.ones(paged.num_blocks, 16, 2)
    with pytest.raises(
        TypeError, match=r"key_cache must have dtype torch.int8, got torch.bfloat16"
    ):
        run(case.query, key, value, paged.key_cache, paged.value_cache, step,
            torch.empty_like(case.query), k_scale=scale, v_scale=scale)  # fmt: skip
