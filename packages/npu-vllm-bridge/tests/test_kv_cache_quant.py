"""8-bit KV caches in the bridge: pages sized and laid out as vLLM's Triton backend lays
them out (the scales' views against vLLM's own ``_ensure_scale_caches``), about half
the bytes of a 16-bit page, and one layer's attention through the impl against
npu-attention's reference on the same pages."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

import npu_attention
from npu_vllm_bridge.attention.backend import NPUBridgeAttentionBackend, NPUBridgeMLABackend
from npu_vllm_bridge.attention.kv_cache import quantized_kv_cache
from npu_vllm_bridge.settings import refuse_kv_cache_dtype

KINDS = ("fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head")
PAGE_DTYPE = {
    "fp8": torch.uint8,
    "fp8_e4m3": torch.uint8,
    "int8_per_token_head": torch.int8,
    "fp8_per_token_head": torch.uint8,
}  # fmt: skip  (vLLM's STR_DTYPE_TO_TORCH_DTYPE)


def _spec(kind: str, head_size: int = 64) -> FullAttentionSpec:
    dtype = torch.bfloat16 if kind == "auto" else PAGE_DTYPE[kind]
    return FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=head_size, dtype=dtype,
                             kv_quant_mode=get_kv_quant_mode(kind))  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_size", [64, 128])
def test_page_bytes_equal_vllms_and_about_halve_a_16_bit_page(kind, head_size):
    ours = NPUBridgeAttentionBackend.customize_spec(_spec(kind, head_size)).page_size_bytes
    theirs = TritonAttentionBackend.customize_spec(_spec(kind, head_size)).page_size_bytes
    assert ours == theirs
    auto = NPUBridgeAttentionBackend.customize_spec(_spec("auto", head_size)).page_size_bytes
    extra = 2 * 4 * 3 * 16 if kind.endswith("per_token_head") else 0  # float32 scales
    assert ours == auto // 2 + extra


def _packed_cache(kind: str, head_size: int, layout_hnd: bool) -> torch.Tensor:
    """vLLM's logical per-layer cache [blocks, kv_heads, block_size, C] with C the
    customized content, physically NHD (the bridge's LBNHC) or HND."""
    content = NPUBridgeAttentionBackend.customize_spec(
        _spec(kind, head_size)
    ).state_content_size_bytes
    blocks, heads, block_size = 5, 3, 16
    if layout_hnd:
        return torch.zeros(blocks, heads, block_size, content, dtype=PAGE_DTYPE[kind])
    return torch.zeros(blocks, block_size, heads, content, dtype=PAGE_DTYPE[kind]).transpose(1, 2)


@pytest.mark.parametrize("kind", ["int8_per_token_head", "fp8_per_token_head"])
@pytest.mark.parametrize("layout_hnd", [False, True])
def test_scale_views_equal_vllms(kind, layout_hnd):
    kv_cache = _packed_cache(kind, 64, layout_hnd)
    _, _, k_scale, v_scale = quantized_kv_cache(kv_cache, 64, kind)
    vllm_impl = TritonAttentionImpl.__new__(TritonAttentionImpl)
    vllm_impl._k_scale_cache = None
    TritonAttentionImpl._ensure_scale_caches(vllm_impl, kv_cache)
    for ours, theirs in ((k_scale, vllm_impl._k_scale_cache), (v_scale, vllm_impl._v_scale_cache)):
        assert ours.shape == theirs.shape == (5, 16, 3)
        assert ours.stride() == theirs.stride()
        assert ours.storage_offset() == theirs.storage_offset()
        assert ours.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()


@pytest.mark.parametrize("kind", KINDS)
def test_pages_written_by_npu_attention_land_where_vllm_reads_them(kind):
    """A row written through the views sits in vLLM's page at [K | k_scale | V | v_scale]."""
    head_size = 64
    kv_cache = _packed_cache(kind, head_size, layout_hnd=False)
    key_cache, value_cache, k_scale, v_scale = quantized_kv_cache(kv_cache, head_size, kind)
    per_tensor = k_scale is None
    if per_tensor:
        k_scale, v_scale = torch.tensor(0.02), torch.tensor(0.03)
    spec = npu_attention.AttentionSpec(3, 3, head_size, 16, dtype=torch.bfloat16,
                                       kv_cache_dtype=kind)  # fmt: skip
    step = npu_attention.plan([0, 1], [1], [[2]], [2 * 16 + 5], 0, spec)
    key = torch.randn(1, 3, head_size).to(torch.bfloat16)
    value = torch.randn(1, 3, head_size).to(torch.bfloat16)
    out = torch.empty(1, 3, head_size, dtype=torch.bfloat16)
    npu_attention.run(key.clone(), key, value, key_cache, value_cache, step, out,
                      k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    row = kv_cache[2, :, 5].view(torch.uint8)  # [heads, C] bytes of slot 5 of block 2
    page_dtype = spec.cache_dtype
    k_codes = row[:, :head_size].view(page_dtype).float()
    pad = 0 if per_tensor else 4
    v_codes = row[:, head_size + pad : 2 * head_size + pad].view(page_dtype).float()
    if per_tensor:
        ks, vs = k_scale, v_scale
    else:
        ks = row[:, head_size : head_size + 4].contiguous().view(torch.float32)
        vs = row[:, 2 * head_size + 4 :].contiguous().view(torch.float32)
    # Dequantized, the page holds the rows within half a code step.
    err_k = (k_codes * ks - key[0].float()).abs()
    err_v = (v_codes * vs - value[0].float()).abs()
    bound = 0.07 * key.float().abs().amax() if page_dtype != torch.int8 else ks.max() / 2 + 1e-6
    assert err_k.max() <= bound
    bound_v = 0.07 * value.float().abs().amax() if page_dtype != torch.int8 else vs.max() / 2 + 1e-6
    assert err_v.max() <= bound_v
    assert k_codes.abs().max() > 0


def test_mla_takes_an_fp8_latent_cache_only():
    for kind in ("auto", "fp8", "fp8_e4m3"):
        assert NPUBridgeMLABackend.supports_kv_cache_dtype(kind), kind
        refuse_kv_cache_dtype(kind, "mla")
    assert not NPUBridgeMLABackend.supports_kv_cache_dtype("int8_per_token_head")
    with pytest.raises(
        ValueError,
        match=r"kv_cache_dtype='int8_per_token_head' for MLA layers with the 'reference' "
        r"attention provider; it takes kv_cache_dtype in \['auto', 'fp8', 'fp8_e4m3'\]",
    ):
        refuse_kv_cache_dtype("int8_per_token_head", "mla")
