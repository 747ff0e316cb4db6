"""Scatter new keys and values into a paged cache by slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from npu_attention.providers.triton_kernels.utils import next_power_of_2

# Elements of one program's [heads, head_size] tile.
_TILE_ELEMENTS = 2048


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
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
    )
    k_dst = block * stride_kcb + offset * stride_kct
    k_dst += offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    tl.store(key_cache_ptr + k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(
        value_ptr + token64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
    )
    v_dst = block * stride_vcb + offset * stride_vct
    v_dst += offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    tl.store(value_cache_ptr + v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[tokens, kv_heads, head_size]`` into the caches.

    Caches are ``[num_blocks, block_size, kv_heads, head_size]``, any strides.
    Token ``t`` goes to slot ``slot_mapping[t]`` (block ``slot // block_size``,
    row ``slot % block_size``); slots ``< 0`` are skipped. Only the first
    ``min(tokens, len(slot_mapping))`` tokens are considered.
    """
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    head_pad = next_power_of_2(head_size)
    block_h = min(next_power_of_2(num_kv_heads), max(1, _TILE_ELEMENTS // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_H=block_h,
        BLOCK_SIZE=key_cache.shape[1],
        num_warps=4,
    )
