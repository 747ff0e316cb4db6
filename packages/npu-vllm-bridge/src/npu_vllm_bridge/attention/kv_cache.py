"""K and V views of vLLM's per-layer KV cache, without copying.

vLLM 0.32 allocates each layer's cache as one region, seen as the logical tensor
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; only the attention
backend reads and writes inside the pages, so it decides what a page holds:

* ``packed`` (vLLM's own convention, FlashAttention's): K and V side by side in
  the last dim; the views are strided.
* ``planes``: the layer's region holds every block's K, then every block's V; the
  views are contiguous ``[num_blocks, block_size, num_kv_heads, head_size]``, what
  Ascend's paged kernels take. Only valid while nothing but the backend touches the
  pages (vLLM zeroes blocks by id only for Mamba or mixed-precision caches, which
  the bridge refuses where it uses planes).

8-bit caches (``--kv-cache-dtype``): vLLM allocates ``uint8`` (fp8 kinds) or ``int8``
pages; a per-token-head kind adds a float32 scale per head and token on each side.
``packed`` holds them as vLLM's Triton backend does (``[K | k_scale | V | v_scale]`` per
head and token); ``planes`` holds the K plane, the V plane, then the K scales and the V
scales, each scale plane head-major ``(num_blocks, num_kv_heads, block_size)`` (what
Ascend's fused attention reads as per-token-head antiquant scales). Both hold the same
bytes, so vLLM's sizing holds for either; ``quantized_kv_cache`` views them.
"""

from __future__ import annotations

from typing import Any

import torch

import npu_attention
from npu_attention.kv_quant import ScaleKind
from npu_vllm_bridge.settings import PREFIX

SPLITS = ("packed", "planes")
SCALE_BYTES = 4  # one float32 scale per head and token, per side


def split_kv_cache(
    kv_cache: torch.Tensor, head_size: int, split: str = "packed"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one layer's cache into the caches npu-attention reads.

    Args:
        kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, any
            physical layout (``planes`` needs the layer's region to be dense).
        head_size: size of one head.
        split: ``"packed"`` or ``"planes"`` (see the module doc).

    Returns:
        ``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads,
        head_size]``, sharing storage with ``kv_cache``.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(
            "expected a KV cache [num_blocks, num_kv_heads, block_size, 2 * head_size] with "
            f"head_size={head_size}, got shape {tuple(kv_cache.shape)}"
        )
    if split == "packed":
        key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
        return key_cache, value_cache
    if split == "planes":
        return _planes(kv_cache, head_size)
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def scale_bytes_per_side(kv_cache_dtype: str) -> int:
    """Bytes a page adds after each head's K row (and V row): a per-token-head kind's
    float32 scale, else none."""
    if npu_attention.kv_quant.scale_kind(kv_cache_dtype) is ScaleKind.PER_TOKEN_HEAD:
        return SCALE_BYTES
    return 0


def quantized_kv_cache(
    kv_cache: torch.Tensor, head_size: int, kv_cache_dtype: str, split: str = "packed"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Views of an 8-bit cache: ``(key_cache, value_cache, k_scales, v_scales)``.

    Args:
        kv_cache: vLLM's ``[num_blocks, num_kv_heads, block_size, C]`` of ``uint8`` or
            ``int8``, ``C = 2 * head_size`` (per-tensor kinds) or ``2 * (head_size + 4)``
            (per-token-head kinds), any physical layout (``planes``: one dense region).
        kv_cache_dtype: one of ``npu_attention.KV_CACHE_DTYPES`` other than ``auto``.
        split: ``"packed"`` or ``"planes"`` (see the module doc).

    Returns:
        ``key_cache`` and ``value_cache`` ``[num_blocks, block_size, num_kv_heads,
        head_size]`` of the kind's page dtype (``float8_e4m3fn`` or ``int8``); for a
        per-token-head kind the float32 scales ``[num_blocks, block_size,
        num_kv_heads]`` of each side (``planes``: head-major strides), else ``None`` (the
        layer's ``_k_scale`` / ``_v_scale`` serve).
    """
    pad = scale_bytes_per_side(kv_cache_dtype)
    width = head_size + pad
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * width or kv_cache.element_size() != 1:
        raise ValueError(
            f"expected an 8-bit KV cache [num_blocks, num_kv_heads, block_size, {2 * width}] "
            f"for kv_cache_dtype={kv_cache_dtype!r}, got {kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    dtype = npu_attention.kv_quant.cache_dtype(kv_cache_dtype, torch.float16)
    if split == "planes":
        return _quantized_planes(kv_cache, head_size, dtype, pad > 0)
    if split != "packed":
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    pages = kv_cache.view(dtype).transpose(1, 2)
    key_cache, value_cache = pages[..., :head_size], pages[..., width : width + head_size]
    if not pad:
        return key_cache, value_cache, None, None
    return (
        key_cache,
        value_cache,
        _scale_view(kv_cache, head_size),
        _scale_view(kv_cache, 2 * width - pad),
    )


def _scale_view(kv_cache: torch.Tensor, offset: int) -> torch.Tensor:
    """float32 ``[num_blocks, block_size, num_kv_heads]`` over the 4 bytes at ``offset``
    of each (block, head, slot) row of the 1-byte ``kv_cache``."""
    strides = kv_cache.stride()
    if (
        any(stride % SCALE_BYTES for stride in strides[:3])
        or (kv_cache.storage_offset() + offset) % SCALE_BYTES
    ):
        raise ValueError(
            f"per-token-head scales need 4-byte aligned rows, got strides {strides} and "
            f"storage offset {kv_cache.storage_offset()}"
        )
    words = torch.empty(0, dtype=torch.float32, device=kv_cache.device)
    words.set_(kv_cache.untyped_storage())
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    return words.as_strided(
        (num_blocks, block_size, num_kv_heads),
        (strides[0] // SCALE_BYTES, strides[2] // SCALE_BYTES, strides[1] // SCALE_BYTES),
        (kv_cache.storage_offset() + offset) // SCALE_BYTES,
    )


def _quantized_planes(
    kv_cache: torch.Tensor, head_size: int, dtype: torch.dtype, with_scales: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """K and V planes of ``dtype`` ``[num_blocks, block_size, num_kv_heads, head_size]``,
    then (``with_scales``) the float32 scale planes, head-major."""
    if not _is_dense(kv_cache):
        raise ValueError(
            "the 'planes' KV split needs each layer's cache to be one dense region, got "
            f"strides {kv_cache.stride()} for shape {tuple(kv_cache.shape)}"
        )
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    plane = num_blocks * block_size * num_kv_heads * head_size
    start = kv_cache.storage_offset()
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    strides = (block_size * num_kv_heads * head_size, num_kv_heads * head_size, head_size, 1)
    key_cache = kv_cache.as_strided(shape, strides, start).view(dtype)
    value_cache = kv_cache.as_strided(shape, strides, start + plane).view(dtype)
    if not with_scales:
        return key_cache, value_cache, None, None
    first = start + 2 * plane
    if first % SCALE_BYTES:
        raise ValueError(
            f"per-token-head scale planes need a 4-byte aligned start, got byte {first}"
        )
    words = torch.empty(0, dtype=torch.float32, device=kv_cache.device)
    words.set_(kv_cache.untyped_storage())
    count = num_blocks * num_kv_heads * block_size
    scale_shape = (num_blocks, block_size, num_kv_heads)
    scale_strides = (num_kv_heads * block_size, 1, block_size)
    k_scales = words.as_strided(scale_shape, scale_strides, first // SCALE_BYTES)
    v_scales = words.as_strided(scale_shape, scale_strides, first // SCALE_BYTES + count)
    return key_cache, value_cache, k_scales, v_scales


def _planes(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not _is_dense(kv_cache):
        raise ValueError(
            "the 'planes' KV split needs each layer's cache to be one dense region, got "
            f"strides {kv_cache.stride()} for shape {tuple(kv_cache.shape)}"
        )
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    plane = (num_blocks, block_size, num_kv_heads, head_size)
    strides = (
        block_size * num_kv_heads * head_size,
        num_kv_heads * head_size,
        head_size,
        1,
    )
    offset = kv_cache.storage_offset()
    key_cache = kv_cache.as_strided(plane, strides, offset)
    value_cache = kv_cache.as_strided(plane, strides, offset + kv_cache.numel() // 2)
    return key_cache, value_cache


def _is_dense(tensor: torch.Tensor) -> bool:
    """True if the tensor's elements fill one gap-free region (any dim order)."""
    expected = 1
    for stride, size in sorted(zip(tensor.stride(), tensor.shape)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def refuse_kv_cache_zeroing(kv_cache_config: Any) -> None:
    """Raise ``ValueError`` for a KV cache (vLLM's ``KVCacheConfig``) that vLLM would zero
    by block: it zeroes blocks by id in its packed page layout, and ``planes`` pages hold
    K and V planes instead (the NPU runners call this)."""
    if kv_cache_config.needs_kv_cache_zeroing:
        raise ValueError(
            f"{PREFIX} does not support models whose KV cache vLLM zeroes by "
            "block (Mamba layers or mixed-precision KV caches) on the NPU"
        )
