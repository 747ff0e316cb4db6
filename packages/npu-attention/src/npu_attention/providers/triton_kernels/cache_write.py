"""Scatter new keys and values into a paged cache by slot mapping, quantizing them for
an 8-bit cache (``npu_attention.kv_quant``: one scale per tensor, or a scale per token
and head computed here and written beside the row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from npu_attention.providers.triton_kernels.utils import next_power_of_2

# Elements of one program's [heads, head_size] tile.
_TILE_ELEMENTS = 2048
# KV_QUANT of the kernel: pages as given, one scale per tensor, a scale per token and head.
QUANT_NONE, QUANT_PER_TENSOR, QUANT_PER_TOKEN_HEAD = 0, 1, 2


@triton.jit
def _quantize_rows(x, scale_ptr, scale_dst, head_mask, KV_QUANT: tl.constexpr,
                   CODE_MAX: tl.constexpr, IS_INT: tl.constexpr):  # fmt: skip
    """``x`` ``[BLOCK_H, HEAD_PAD]`` as the cache's codes (float32, before the store's
    cast): divided by the tensor's scale, or by each head row's ``max(absmax / CODE_MAX,
    1e-6)``, which is stored at ``scale_dst``; saturated, int8 rounded half away."""
    x = x.to(tl.float32)
    if KV_QUANT == 1:
        x = x / tl.load(scale_ptr)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), 1) / CODE_MAX, 1e-6)
        tl.store(scale_dst, scale, mask=head_mask)
        x = x * (1.0 / scale)[:, None]
    if IS_INT:
        x = tl.where(x >= 0, x + 0.5, x - 0.5)
        return tl.minimum(tl.maximum(x, -128.0), 127.0)
    return _round_to_e4m3(tl.minimum(tl.maximum(x, -CODE_MAX), CODE_MAX))


@triton.jit
def _round_to_e4m3(x):
    """float32 ``x`` (``|x| <= 448``) rounded to the nearest e4m3 value, ties to even,
    in float32 arithmetic, so the store's cast is exact. (Triton's interpreter rounds a
    mantissa up without carrying into the exponent: 124.8 became 64, not 128.)"""
    a = tl.abs(x)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; subnormal below 2**-6
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2**23: adding it rounds to an integer, ties to even
    rounded = ((a * inverse + magic) - magic) * step
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vcd,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_vsb,
    stride_vst,
    stride_vsh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    CODE_MAX: tl.constexpr,
    IS_INT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_SIZE)[None, :]
    token64 = token.to(tl.int64)

    k = tl.load(
        key_ptr + token64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
        other=0.0,  # padding lanes stay out of a row's absmax
    )
    if KV_QUANT > 0:
        k_scale_dst = k_scale_ptr + block * stride_ksb + offset * stride_kst + offs_h * stride_ksh
        head_mask = offs_h < NUM_KV_HEADS
        k = _quantize_rows(k, k_scale_ptr, k_scale_dst, head_mask, KV_QUANT, CODE_MAX, IS_INT)
    k_dst = block * stride_kcb + offset * stride_kct
    k_dst += offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    tl.store(key_cache_ptr + k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(
        value_ptr + token64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
        other=0.0,
    )
    if KV_QUANT > 0:
        v_scale_dst = v_scale_ptr + block * stride_vsb + offset * stride_vst + offs_h * stride_vsh
        head_mask = offs_h < NUM_KV_HEADS
        v = _quantize_rows(v, v_scale_ptr, v_scale_dst, head_mask, KV_QUANT, CODE_MAX, IS_INT)
    v_dst = block * stride_vcb + offset * stride_vct
    v_dst += offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    tl.store(value_cache_ptr + v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[tokens, kv_heads, head_size]`` into the caches.

    Caches are ``[num_blocks, block_size, kv_heads, head_size]``, any strides.
    Token ``t`` goes to slot ``slot_mapping[t]`` (block ``slot // block_size``,
    row ``slot % block_size``); slots ``< 0`` are skipped. Only the first
    ``min(tokens, len(slot_mapping))`` tokens are considered.

    8-bit caches (int8, float8_e4m3fn) take float32 ``k_scale``/``v_scale``: one element
    each (the rows are divided by it), or ``[num_blocks, block_size, kv_heads]`` (any
    strides) that get each row's scale, as ``npu_attention.kv_quant`` defines them.
    """
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    head_pad = next_power_of_2(head_size)
    block_h = min(next_power_of_2(num_kv_heads), max(1, _TILE_ELEMENTS // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    quant, scales, scale_strides = _quant_args(k_scale, v_scale, key)
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *scales,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *scale_strides,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_H=block_h,
        BLOCK_SIZE=key_cache.shape[1],
        KV_QUANT=quant,
        CODE_MAX=127.0 if key_cache.dtype == torch.int8 else 448.0,
        IS_INT=key_cache.dtype == torch.int8,
        num_warps=4,
    )


def _quant_args(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, placeholder: torch.Tensor
) -> tuple[int, tuple[torch.Tensor, torch.Tensor], tuple[int, ...]]:
    """``KV_QUANT``, the two scale pointers and their six strides (block, slot, head)."""
    if k_scale is None:
        return QUANT_NONE, (placeholder, placeholder), (0,) * 6
    if k_scale.dim() == 3:
        return QUANT_PER_TOKEN_HEAD, (k_scale, v_scale), (*k_scale.stride(), *v_scale.stride())
    return QUANT_PER_TENSOR, (k_scale, v_scale), (0,) * 6
