"""8-bit KV caches in ``planes`` pages (the NPU platform's split): the K plane, the V plane,
then head-major float32 scale planes, in the bytes vLLM sizes for the packed page; one
layer through npu-attention's reference provider on the planes gives what it gives on
vLLM's packed pages of the same rows."""

from __future__ import annotations

import itertools

import pytest
import torch

import npu_attention
from npu_vllm_bridge.attention.kv_cache import quantized_kv_cache

BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE = 5, 2, 16, 64
KINDS = {"int8_per_token_head": torch.int8, "fp8_per_token_head": torch.uint8, "fp8": torch.uint8}


def _region(kind: str) -> torch.Tensor:
    """vLLM's logical per-layer cache ``[blocks, kv_heads, block_size, C]`` (token-major
    pages, the bridge's layout), C the packed page's bytes per head and token."""
    content = 2 * (HEAD_SIZE + (4 if kind.endswith("per_token_head") else 0))
    region = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, content, dtype=KINDS[kind])
    return region.transpose(1, 2)


def _byte_ranges(*views: torch.Tensor) -> list[tuple[int, int]]:
    ranges = []
    for view in views:
        start = view.data_ptr()
        span = sum((n - 1) * s for n, s in zip(view.shape, view.stride())) + 1
        ranges.append((start, start + span * view.element_size()))
    return sorted(ranges)


@pytest.mark.parametrize("kind", KINDS)
def test_planes_tile_the_region_vllm_sizes(kind):
    region = _region(kind)
    key_cache, value_cache, k_scale, v_scale = quantized_kv_cache(region, HEAD_SIZE, kind, "planes")
    page_dtype = npu_attention.kv_quant.cache_dtype(kind, torch.bfloat16)
    for cache in (key_cache, value_cache):
        assert cache.shape == (BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE) and cache.is_contiguous()
        assert cache.dtype == page_dtype
    views = [key_cache, value_cache]
    if kind.endswith("per_token_head"):
        for scale in (k_scale, v_scale):
            assert scale.dtype == torch.float32 and scale.shape == (BLOCKS, BLOCK_SIZE, HEADS)
            assert scale.permute(0, 2, 1).is_contiguous()  # (blocknum, N, blocksize)
        views += [k_scale, v_scale]
    else:
        assert k_scale is None and v_scale is None
    ranges = _byte_ranges(*views)
    base = region.data_ptr()
    assert ranges[0][0] == base and ranges[-1][1] == base + region.numel()
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), ranges  # gap-free, disjoint


def test_a_strided_region_is_refused():
    region = _region("int8_per_token_head")[:, :, ::2]
    with pytest.raises(ValueError, match="one dense region"):
        quantized_kv_cache(region, HEAD_SIZE, "int8_per_token_head", "planes")


@pytest.mark.parametrize("kind", ["int8_per_token_head", "fp8_per_token_head"])
def test_reference_attention_on_planes_equals_packed_pages(kind):
    spec = npu_attention.AttentionSpec(
        4, HEADS, HEAD_SIZE, BLOCK_SIZE, dtype=torch.bfloat16, kv_cache_dtype=kind
    )
    generator = torch.Generator().manual_seed(0)
    # Two requests: 20 context tokens then 3 new, and 1 new token alone.
    step = npu_attention.plan(
        [0, 23, 24], [23, 1], [[3, 1], [4, 0]],
        [*(3 * 16 + i for i in range(16)), *(16 + i for i in range(7)), 4 * 16], 0, spec,
    )  # fmt: skip
    query = torch.randn(24, 4, HEAD_SIZE, generator=generator).to(torch.bfloat16)
    key = torch.randn(24, HEADS, HEAD_SIZE, generator=generator).to(torch.bfloat16)
    value = torch.randn(24, HEADS, HEAD_SIZE, generator=generator).to(torch.bfloat16)
    outs = []
    for split in ("packed", "planes"):
        caches = quantized_kv_cache(_region(kind), HEAD_SIZE, kind, split)
        out = torch.zeros_like(query)
        npu_attention.run(
            query, key, value, caches[0], caches[1], step, out, k_scale=caches[2],
            v_scale=caches[3],
        )  # fmt: skip
        outs.append((out, *caches))
    packed, planes = outs
    for a, b in zip(packed, planes):
        assert torch.equal(a, b)
