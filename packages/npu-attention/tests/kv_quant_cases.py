"""Batches over quantized KV caches, and the float64 oracle on the dequantized cache.

The context of each request is quantized here with ``npu_attention.kv_quant``'s
definitions (vLLM's) and laid into pages of ``spec.cache_dtype``; memory no request
owns holds NaN codes (fp8) or NaN scales (per token and head), so a read outside a
request's pages shows up. ``run`` then writes the step's rows itself; the oracle sees
every key dequantized (``code * scale``), except a prefill without cached context,
which attends over its own rows unquantized.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from npu_attention_cases import Case, PagedCase, naive_attention

from npu_attention import AttentionPlan, BatchState, kv_quant, plan, run
from npu_attention.kv_quant import ScaleKind

QUANTIZED_KINDS = ("fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head")
INT8_SENTINEL = 99  # int8 codes of slots no request owns (their scales are NaN)


@dataclass
class QuantPaged:
    paged: PagedCase  # tables, slots; its caches hold the quantized pages
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def per_tensor_scales(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibrated scales, as a checkpoint would bring them: absmax / 448 of each side."""
    device = case.query.device
    k = max(float(k.abs().max()) for k in case.keys) / kv_quant.FP8_MAX
    v = max(float(v.abs().max()) for v in case.values) / kv_quant.FP8_MAX
    return (
        torch.tensor([k], dtype=torch.float32, device=device),
        torch.tensor([v], dtype=torch.float32, device=device),
    )


def quantize_rows(
    rows: torch.Tensor, spec, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes of ``rows`` ``[n, kv_heads, d]`` and, per token and head, their scales."""
    if spec.kv_scales is ScaleKind.PER_TENSOR:
        return kv_quant.quantize_per_tensor(rows, scale), None
    return kv_quant.quantize_per_token_head(rows, spec.cache_dtype)


def dequantized(rows: torch.Tensor, spec, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 ``rows`` after a round trip through the cache."""
    codes, row_scales = quantize_rows(rows, spec, scale)
    if row_scales is None:
        return kv_quant.dequantize(codes, scale)
    return kv_quant.dequantize(codes, row_scales.unsqueeze(-1))


def quantized_paged(
    case: Case,
    seed: int = 0,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    head_major: bool = False,
) -> QuantPaged:
    """``case.paged`` with pages of ``spec.cache_dtype`` holding the quantized context;
    ``scales``: per-tensor scales to use (default: ``per_tensor_scales(case)``);
    ``head_major``: pages and per-token-head scales laid with each KV head's tokens of a
    page contiguous (the same logical tensors)."""
    spec = case.spec
    paged = case.paged(np.random.default_rng(seed))
    device = case.query.device
    shape = paged.key_cache.shape
    scale_shape = shape[:3]
    if spec.cache_dtype == torch.int8:
        fill = lambda: torch.full(shape, INT8_SENTINEL, dtype=torch.int8, device=device)  # noqa: E731
    else:
        fill = lambda: torch.full(shape, float("nan"), device=device).to(spec.cache_dtype)  # noqa: E731
    key_cache, value_cache = fill(), fill()
    if spec.kv_scales is ScaleKind.PER_TENSOR:
        k_scale, v_scale = per_tensor_scales(case) if scales is None else scales
    else:
        k_scale = torch.full(scale_shape, float("nan"), device=device)
        v_scale = torch.full(scale_shape, float("nan"), device=device)
    bs = spec.block_size
    for i, ctx in enumerate(case.context_lens):
        pos = np.arange(ctx)
        slots = paged.block_tables[i, pos // bs].numpy() * bs + pos % bs
        where = (torch.from_numpy(slots // bs).to(device), torch.from_numpy(slots % bs).to(device))
        for rows, cache, scale in (
            (case.keys[i][:ctx], key_cache, k_scale),
            (case.values[i][:ctx], value_cache, v_scale),
        ):
            codes, row_scales = quantize_rows(rows, spec, scale)
            cache[where] = codes
            if row_scales is not None:
                scale[where] = row_scales
    if head_major:
        key_cache, value_cache = (_head_major(c) for c in (key_cache, value_cache))
        if spec.kv_scales is not ScaleKind.PER_TENSOR:
            k_scale, v_scale = _head_major(k_scale), _head_major(v_scale)
    quant = dataclasses.replace(paged, key_cache=key_cache, value_cache=value_cache)
    return QuantPaged(quant, k_scale, v_scale)


def _head_major(pages: torch.Tensor) -> torch.Tensor:
    """``pages`` ``[num_blocks, block_size, kv_heads, ...]``, the same values, each KV
    head's tokens of a page contiguous."""
    return pages.transpose(1, 2).contiguous().transpose(1, 2)


def run_quantized(
    case: Case, seed: int = 0, *, provider: str = "reference", head_major: bool = False
) -> tuple[torch.Tensor, QuantPaged, AttentionPlan]:
    """plan + run over the quantized pages (``quantized_paged``); ``out`` starts as a
    sentinel (-3)."""
    quant = quantized_paged(case, seed, head_major=head_major)
    paged, device = quant.paged, case.query.device
    step = plan(
        case.cu_seqlens_q,
        case.seq_lens,
        paged.block_tables.to(device),
        paged.slot_mapping.to(device),
        case.num_decodes,
        case.spec,
        provider=provider,
    )
    key, value = case.new_kv()
    out = torch.full_like(case.query, -3.0)
    run(
        case.query, key, value, paged.key_cache, paged.value_cache, step, out,
        k_scale=quant.k_scale, v_scale=quant.v_scale,
    )  # fmt: skip
    return out, quant, step


def dequantized_case(case: Case, quant: QuantPaged, state: BatchState) -> Case:
    """``case`` with the keys and values attention reads: dequantized, but a prefill
    without cached context reads its own rows."""
    if state is BatchState.PREFILL_NO_CACHE:
        return case
    spec = case.spec
    per_tensor = spec.kv_scales is ScaleKind.PER_TENSOR
    k_scale = quant.k_scale if per_tensor else None
    v_scale = quant.v_scale if per_tensor else None
    return dataclasses.replace(
        case,
        keys=[dequantized(k, spec, k_scale) for k in case.keys],
        values=[dequantized(v, spec, v_scale) for v in case.values],
    )


def oracle(case: Case, quant: QuantPaged, state: BatchState) -> torch.Tensor:
    """Dense float64 attention over what the quantized cache holds."""
    return naive_attention(dequantized_case(case, quant, state))


def _assert_within_a_step(got: torch.Tensor, expected: torch.Tensor, dtype) -> None:
    """Codes at most one quantization step apart (int8: 1; e4m3: 1/8 relative, or one
    subnormal step)."""
    got, expected = got.float(), expected.float()
    assert not got.isnan().any()
    step = 1.0 if dtype == torch.int8 else torch.clamp(expected.abs() / 8, min=2.0**-9)
    assert ((got - expected).abs() <= step + 1e-6).all()


def assert_rows_written(case: Case, quant: QuantPaged, *, exact: bool = True) -> None:
    """Each new row sits at its slot quantized as the definitions say (per-token-head
    scales beside it); memory no request owns is untouched. ``exact=False`` (a GPU
    kernel, whose float32 division is not correctly rounded): codes may be one step off."""
    spec, paged, bs = case.spec, quant.paged, case.spec.block_size
    key, value = case.new_kv()
    n = case.num_tokens
    slots = paged.slot_mapping[:n].to(key.device)
    where = (slots // bs, slots % bs)
    for rows, cache, scale in (
        (key[:n], paged.key_cache, quant.k_scale),
        (value[:n], paged.value_cache, quant.v_scale),
    ):
        codes, row_scales = quantize_rows(rows, spec, scale)
        if exact:
            assert torch.equal(cache[where].view(torch.uint8), codes.view(torch.uint8))
        else:
            _assert_within_a_step(cache[where], codes, spec.cache_dtype)
        if row_scales is not None:
            tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-6, "atol": 0}
            torch.testing.assert_close(scale[where], row_scales, **tolerance)
    owned = torch.zeros(paged.num_blocks, bs, dtype=torch.bool)
    for i, seq in enumerate(case.seq_lens):
        pos = torch.arange(seq)
        owned[paged.block_tables[i, pos // bs], pos % bs] = True
    for cache, scale in ((paged.key_cache, quant.k_scale), (paged.value_cache, quant.v_scale)):
        if spec.kv_scales is ScaleKind.PER_TOKEN_HEAD:
            assert scale.cpu()[~owned].isnan().all(), "scales written outside the requests"
        if spec.cache_dtype == torch.int8:
            assert (cache.cpu()[~owned] == INT8_SENTINEL).all(), "rows written outside"
        else:
            assert cache.cpu()[~owned].float().isnan().all(), "rows written outside"
