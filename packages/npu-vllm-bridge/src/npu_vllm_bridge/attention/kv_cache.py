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
"""

from __future__ import annotations

from typing import Any

import torch

from npu_vllm_bridge.settings import PREFIX

SPLITS = ("packed", "planes")


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
