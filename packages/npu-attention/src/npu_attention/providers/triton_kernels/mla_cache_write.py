"""Scatter new MLA latents (``kv_c``, ``k_pe``) into a paged latent cache by slot; for
an fp8 cache (vLLM's MLA ``fp8``), as e4m3 codes of ``x / scale`` with the cache's one
scale (``npu_attention.kv_quant.quantize_per_tensor``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from npu_attention.providers.triton_kernels.cache_write import _round_to_e4m3
from npu_attention.providers.triton_kernels.utils import next_power_of_2


@triton.jit
def _codes(x, scale_ptr, FP8: tl.constexpr):
    """``x`` as the cache stores it, before the store's cast: as it is, or (``FP8``)
    ``x / scale`` saturated and rounded to e4m3 in float32 (the cast is then exact)."""
    if FP8:
        x = x.to(tl.float32) / tl.load(scale_ptr)
        return _round_to_e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0))
    return x


@triton.jit
def _write_latent_kernel(
    kv_c_ptr,
    k_pe_ptr,
    kv_c_cache_ptr,
    k_pe_cache_ptr,
    slot_mapping_ptr,
    scale_ptr,
    stride_ct,
    stride_cd,
    stride_pt,
    stride_pd,
    stride_ccb,
    stride_ccs,
    stride_ccd,
    stride_pcb,
    stride_pcs,
    stride_pcd,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // PAGE
    offset = slot % PAGE
    offs_l = tl.arange(0, LATENT_PAD)
    kv_c = tl.load(kv_c_ptr + token * stride_ct + offs_l * stride_cd, mask=offs_l < LATENT)
    tl.store(
        kv_c_cache_ptr + block * stride_ccb + offset * stride_ccs + offs_l * stride_ccd,
        _codes(kv_c, scale_ptr, FP8).to(kv_c_cache_ptr.dtype.element_ty),
        mask=offs_l < LATENT,
    )
    offs_r = tl.arange(0, ROPE_PAD)
    k_pe = tl.load(k_pe_ptr + token * stride_pt + offs_r * stride_pd, mask=offs_r < ROPE)
    tl.store(
        k_pe_cache_ptr + block * stride_pcb + offset * stride_pcs + offs_r * stride_pcd,
        _codes(k_pe, scale_ptr, FP8).to(k_pe_cache_ptr.dtype.element_ty),
        mask=offs_r < ROPE,
    )


def write_latent_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    scale: torch.Tensor | None = None,
) -> None:
    """Write ``kv_c`` ``[tokens, L]`` and ``k_pe`` ``[tokens, R]`` of the first
    ``num_tokens`` tokens into ``[blocks, block_size, L]`` / ``[blocks, block_size, R]``
    caches (any strides) at ``slot_mapping``; slots ``< 0`` are skipped. ``scale``
    (float32, one element): the caches are float8_e4m3fn and take ``x / scale``."""
    if num_tokens == 0:
        return
    latent, rope = kv_c.shape[1], k_pe.shape[1]
    _write_latent_kernel[(num_tokens,)](
        kv_c,
        k_pe,
        kv_c_cache,
        k_pe_cache,
        slot_mapping,
        slot_mapping if scale is None else scale,  # unused without FP8
        *kv_c.stride(),
        *k_pe.stride(),
        *kv_c_cache.stride(),
        *k_pe_cache.stride(),
        LATENT=latent,
        LATENT_PAD=next_power_of_2(latent),
        ROPE=rope,
        ROPE_PAD=next_power_of_2(rope),
        PAGE=kv_c_cache.shape[1],
        FP8=scale is not None,
        num_warps=4,
    )
