"""The paged latent cache: ``kv_c`` and ``k_pe`` planes addressed by slot."""

from __future__ import annotations

from typing import NamedTuple

import torch

from npu_attention.mla.spec import MLASpec


class LatentCache(NamedTuple):
    """One layer's paged latent cache, one latent "head" per token.

    Slot ``s`` holds token data at ``[s // block_size, s % block_size]`` of both planes.

    Attributes:
        kv_c: ``[num_blocks, block_size, kv_lora_rank]``, the compressed KV.
        k_pe: ``[num_blocks, block_size, qk_rope_head_dim]``, the rotary key.
    """

    kv_c: torch.Tensor
    k_pe: torch.Tensor


def split_latent_cache(cache: torch.Tensor, spec: MLASpec) -> LatentCache:
    """Views of a token-interleaved ``[num_blocks, block_size, kv_lora_rank +
    qk_rope_head_dim]`` cache (vLLM's MLA layout): no copy, not contiguous.

    Raises:
        ValueError: a shape other than ``[*, block_size, latent_dim]``.
        TypeError: a dtype other than ``spec.cache_dtype``.
    """
    expected = (spec.block_size, spec.latent_dim)
    if cache.dim() != 3 or tuple(cache.shape[1:]) != expected:
        raise ValueError(
            f"latent cache must be [num_blocks, {expected[0]}, {expected[1]}], "
            f"got {tuple(cache.shape)}"
        )
    _check_dtype(cache, spec)
    kv_c, k_pe = cache.split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
    return LatentCache(kv_c, k_pe)


def latent_cache_planes(storage: torch.Tensor, spec: MLASpec) -> LatentCache:
    """Two contiguous planes carved from ``storage``: all ``kv_c`` rows, then all
    ``k_pe`` rows (what the ascend provider needs; the reference and Triton take them too).

    Args:
        storage: a contiguous tensor of ``spec.cache_dtype`` whose element count is a
            multiple of ``block_size * latent_dim`` (e.g. vLLM's per-layer MLA cache
            ``[num_blocks, block_size, latent_dim]`` reinterpreted; its previous
            contents are not preserved as latent rows).

    Raises:
        ValueError: non-contiguous storage or a size that is not whole blocks.
        TypeError: a dtype other than ``spec.cache_dtype``.
    """
    _check_dtype(storage, spec)
    if not storage.is_contiguous():
        raise ValueError("latent cache storage must be contiguous")
    per_block = spec.block_size * spec.latent_dim
    if storage.numel() == 0 or storage.numel() % per_block:
        raise ValueError(
            f"latent cache storage must hold whole blocks of {spec.block_size} x "
            f"{spec.latent_dim} elements, got {storage.numel()} elements"
        )
    num_blocks = storage.numel() // per_block
    flat = storage.view(-1)
    split = num_blocks * spec.block_size * spec.kv_lora_rank
    kv_c = flat[:split].view(num_blocks, spec.block_size, spec.kv_lora_rank)
    k_pe = flat[split:].view(num_blocks, spec.block_size, spec.qk_rope_head_dim)
    return LatentCache(kv_c, k_pe)


def allocate_latent_cache(
    num_blocks: int, spec: MLASpec, device: torch.device | str = "cpu"
) -> LatentCache:
    """A zeroed cache of ``num_blocks`` pages as two contiguous planes of one allocation.

    Not used by the vLLM bridge today (vLLM allocates the cache; the bridge takes views
    of it); for engines that own their cache, and for tests."""
    storage = torch.zeros(
        num_blocks * spec.block_size * spec.latent_dim, dtype=spec.cache_dtype, device=device
    )
    return latent_cache_planes(storage, spec)


def check_latent_cache(cache: LatentCache, spec: MLASpec, device: torch.device) -> None:
    """Raise unless ``cache`` holds two planes of the spec's widths, dtype and device.

    Raises:
        TypeError: not a ``LatentCache`` / pair of tensors, or a wrong dtype.
        ValueError: wrong shapes, block counts that differ, or another device.
    """
    if not isinstance(cache, tuple) or len(cache) != 2:
        raise TypeError(f"cache must be a LatentCache (kv_c, k_pe), got {type(cache).__name__}")
    for name, plane, width in (
        ("kv_c", cache[0], spec.kv_lora_rank),
        ("k_pe", cache[1], spec.qk_rope_head_dim),
    ):
        if not isinstance(plane, torch.Tensor):
            raise TypeError(f"cache.{name} must be a torch.Tensor, got {type(plane).__name__}")
        if plane.dim() != 3 or tuple(plane.shape[1:]) != (spec.block_size, width):
            raise ValueError(
                f"cache.{name} must be [num_blocks, {spec.block_size}, {width}], "
                f"got {tuple(plane.shape)}"
            )
        _check_dtype(plane, spec, f"cache.{name}")
        if plane.device != device:
            raise ValueError(f"cache.{name} must be on {device}, got {plane.device}")
    if cache[0].shape[0] != cache[1].shape[0]:
        raise ValueError(
            f"cache.kv_c and cache.k_pe must have as many blocks, got "
            f"{cache[0].shape[0]} and {cache[1].shape[0]}"
        )


def _check_dtype(tensor: torch.Tensor, spec: MLASpec, name: str = "latent cache") -> None:
    if tensor.dtype != spec.cache_dtype:
        raise TypeError(f"{name} must have dtype {spec.cache_dtype}, got {tensor.dtype}")
