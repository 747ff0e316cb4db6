"""K and V views of vLLM's packed per-layer KV cache, without copying."""

from __future__ import annotations

import torch


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split vLLM's per-layer cache into the caches npu-attention reads.

    Args:
        kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM 0.32's
            logical shape; K in the first half of the last dim, V in the second),
            any physical layout.
        head_size: size of one head.

    Returns:
        ``(key_cache, value_cache)``, each a view ``[num_blocks, block_size,
        num_kv_heads, head_size]`` sharing storage with ``kv_cache``.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(
            "expected a KV cache [num_blocks, num_kv_heads, block_size, 2 * head_size] with "
            f"head_size={head_size}, got shape {tuple(kv_cache.shape)}"
        )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache
