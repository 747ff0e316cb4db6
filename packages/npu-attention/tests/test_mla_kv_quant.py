"""An fp8 latent cache (MLA ``kv_cache_dtype`` ``fp8`` / ``fp8_e4m3``, one scale for the
cache, as vLLM's MLA layers keep it) on the reference MLA provider: every batch state
against the float64 MLA oracle on the dequantized latents, at ``MLA_TOLERANCE``; the
rows written as the definition says; bad scales refused before anything is written."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from mla_cases import MLA_TOLERANCE, SMALL_SPEC, make_mla_case, oracle_decode, oracle_prefill

from npu_attention import kv_quant, plan
from npu_attention.mla import LatentCache, MLASpec, mla_decode, mla_prefill, mla_write_cache

STATES = {  # name: (query_lens, context_lens, num_decodes, num_speculative_tokens)
    "prefill_no_cache": ([5, 19, 1], [0, 0, 0], 0, 0),
    "prefill_cache_hit": ([7, 3], [21, 40], 0, 0),
    "chunked_prefill": ([1, 1, 6, 9], [30, 4, 17, 0], 2, 0),
    "decode_only": ([1, 1, 1], [15, 16, 17], 3, 0),
    "spec_decoding": ([3, 3, 2], [12, 40, 5], 3, 2),
}


def _spec(kind: str, dtype: torch.dtype = torch.float32, **overrides) -> MLASpec:
    return MLASpec(**{**SMALL_SPEC, "block_size": 16, "dtype": dtype, "kv_cache_dtype": kind,
                      **overrides})  # fmt: skip


def _scale(case) -> torch.Tensor:
    top = max(float(lat.abs().max()) for lat in case.latents)
    return torch.tensor([top / kv_quant.FP8_MAX], dtype=torch.float32)


def _quantized_paged(case, scale: torch.Tensor):
    """``case.paged`` of the same batch in the model dtype, its cache quantized (NaN
    where no request's context is, NaN codes after quantizing)."""
    auto = dataclasses.replace(case, spec=dataclasses.replace(case.spec, kv_cache_dtype="auto"))
    paged = auto.paged(np.random.default_rng(0))
    cache = LatentCache(*(kv_quant.quantize_per_tensor(p, scale) for p in paged.cache))
    return dataclasses.replace(paged, cache=cache)


def _run(case, scale: torch.Tensor):
    paged = _quantized_paged(case, scale)
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables, paged.slot_mapping,
                case.num_decodes, case.spec)  # fmt: skip
    kv_c, k_pe = case.new_latents()
    mla_write_cache(kv_c, k_pe, paged.cache, step, k_scale=scale)
    decode_out = torch.full_like(case.q_latent, -3.0)
    prefill_out = case.query.new_full(
        (case.query.shape[0], case.spec.num_heads, case.spec.v_head_dim), -3.0
    )
    mla_decode(case.q_latent, case.q_rope, paged.cache, step, decode_out, k_scale=scale)
    mla_prefill(case.query, paged.cache, step, case.kv_up_proj, prefill_out, k_scale=scale)
    return decode_out, prefill_out, paged


def _dequantized(case, scale: torch.Tensor):
    """``case`` with its latents as the fp8 cache holds them."""
    rows = [
        kv_quant.dequantize(kv_quant.quantize_per_tensor(lat, scale), scale).to(case.spec.dtype)
        for lat in case.latents
    ]
    return dataclasses.replace(case, latents=rows)


@pytest.mark.parametrize("kind", ["fp8", "fp8_e4m3"])
@pytest.mark.parametrize("name", list(STATES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_states_against_the_dequantized_latents(kind, name, dtype):
    query_lens, context_lens, num_decodes, spec_tokens = STATES[name]
    spec = _spec(kind, dtype, num_speculative_tokens=spec_tokens)
    case = make_mla_case(spec, query_lens, context_lens, num_decodes, pad_tokens=2)
    scale = _scale(case)
    decode_out, prefill_out, paged = _run(case, scale)
    expected = _dequantized(case, scale)
    nd, npf = case.num_decode_tokens, case.num_tokens - case.num_decode_tokens
    tolerance = MLA_TOLERANCE[dtype]
    torch.testing.assert_close(decode_out[:nd].double(), oracle_decode(expected), **tolerance)
    torch.testing.assert_close(prefill_out[:npf].double(), oracle_prefill(expected), **tolerance)
    assert (decode_out[nd:] == -3.0).all() and (prefill_out[npf:] == -3.0).all()
    # The step's rows sit at their slots as fp8 codes of x / scale; nothing else changed.
    bs, n = spec.block_size, case.num_tokens
    slots = paged.slot_mapping[:n]
    kv_c, k_pe = case.new_latents()
    for plane, rows in ((paged.cache.kv_c, kv_c), (paged.cache.k_pe, k_pe)):
        codes = kv_quant.quantize_per_tensor(rows[:n], scale)
        assert torch.equal(
            plane[slots // bs, slots % bs].view(torch.uint8), codes.view(torch.uint8)
        )
    owned = torch.zeros(paged.num_blocks, bs, dtype=torch.bool)
    for i, seq in enumerate(case.seq_lens):
        pos = torch.arange(seq)
        owned[paged.block_tables[i, pos // bs], pos % bs] = True
    assert paged.cache.kv_c[~owned].float().isnan().all()


def test_quantization_error_of_the_fp8_latent_cache():
    """Against the oracle on the unquantized latents: bounded, and not zero."""
    spec = _spec("fp8")
    case = make_mla_case(spec, [1, 1, 1, 12], [40, 90, 7, 20], 3, seed=3)
    decode_out, prefill_out, _ = _run(case, _scale(case))
    nd, npf = case.num_decode_tokens, case.num_tokens - case.num_decode_tokens
    errors = [
        (decode_out[:nd].double() - oracle_decode(case)).abs().max().item(),
        (prefill_out[:npf].double() - oracle_prefill(case)).abs().max().item(),
    ]
    assert all(1e-4 < error < 0.1 for error in errors), errors


def test_spec_takes_the_per_tensor_kinds_only():
    assert _spec("fp8").cache_dtype == torch.float8_e4m3fn
    assert _spec("auto").cache_dtype == torch.float32
    with pytest.raises(
        ValueError,
        match=r"MLA kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\], "
        r"got 'int8_per_token_head'",
    ):
        _spec("int8_per_token_head")


@pytest.mark.parametrize(
    ("kind", "k_scale", "error", "message"),
    [
        ("fp8", None, ValueError, r"MLA kv_cache_dtype='fp8' needs k_scale: a float32 tensor of one element, got NoneType"),
        ("fp8", torch.ones(2), ValueError, r"k_scale of MLA kv_cache_dtype='fp8' must have one element, got shape \[2\]"),
        ("fp8", torch.ones(1, dtype=torch.float64), TypeError, r"k_scale must have dtype torch.float32, got torch.float64"),
        ("auto", torch.ones(1), ValueError, r"MLA kv_cache_dtype='auto' takes no k_scale, got \[1\]"),
    ],
)  # fmt: skip
def test_bad_scales_are_refused_before_anything_is_written(kind, k_scale, error, message):
    spec = _spec(kind)
    case = make_mla_case(spec, [1, 4], [9, 0], 1)
    if kind == "auto":
        paged = case.paged(np.random.default_rng(0))
    else:
        paged = _quantized_paged(case, _scale(case))
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables, paged.slot_mapping,
                case.num_decodes, spec)  # fmt: skip
    before = [p.clone() for p in paged.cache]
    kv_c, k_pe = case.new_latents()
    with pytest.raises(error, match=message):
        mla_write_cache(kv_c, k_pe, paged.cache, step, k_scale=k_scale)
    out = torch.full_like(case.q_latent, -3.0)
    with pytest.raises(error, match=message):
        mla_decode(case.q_latent, case.q_rope, paged.cache, step, out, k_scale=k_scale)
    for old, new in zip(before, paged.cache):
        assert torch.equal(old.view(torch.uint8), new.view(torch.uint8))
    assert (out == -3.0).all()


def test_a_provider_without_the_kind_is_refused_by_plan(monkeypatch):
    """A provider that keeps an ``auto`` latent cache (the Triton MLA provider made to):
    ``plan`` names what it takes."""
    pytest.importorskip("triton")
    from npu_attention.providers.triton_mla import TritonMLAProvider

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(TritonMLAProvider, "kv_cache_dtypes", ("auto",))
    spec = _spec("fp8")
    case = make_mla_case(spec, [1], [5], 1)
    with pytest.raises(
        ValueError,
        match=r"attention provider 'triton' does not support kv_cache_dtype='fp8'; "
        r"it takes \['auto'\]",
    ):
        plan(case.cu_seqlens_q, case.seq_lens, [[1]], [5], 1, spec, provider="triton")
