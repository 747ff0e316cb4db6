"""Per-tensor KV-cache scales (``fp8`` / ``fp8_e4m3``) from a checkpoint reach the pages.

vLLM keeps them on each attention layer: ``_k_scale`` / ``_v_scale`` start at 1.0
(``set_default_quant_scales``), and a quantization config's KV-cache method replaces
them with the checkpoint's after loading (``process_weights_after_loading``). Here a
stand-in layer goes through vLLM's own code for both steps (compressed-tensors'
``kv_cache_scheme`` method for GQA, the base method that ModelOpt uses for MLA layers),
then through the bridge's impls; the rows written into the 8-bit pages must dequantize,
with the checkpoint's scale, to what the layer handed in (within e4m3's rounding), and
the MLA decode must read them with it (against attention over the dequantized cache).
Without a checkpoint scale the layer keeps vLLM's 1.0, and so do the pages.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.attention import set_default_quant_scales
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
    CompressedTensorsKVCacheMethod,
)
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

import npu_attention
from npu_attention.mla import MLASpec
from npu_vllm_bridge.attention.builder import BridgeAttentionMetadata
from npu_vllm_bridge.attention.impl import BridgeAttentionImpl
from npu_vllm_bridge.attention.mla_builder import BridgeMLAMetadata, MLARows
from npu_vllm_bridge.attention.mla_impl import BridgeMLAImpl

HEADS, KV_HEADS, HEAD = 4, 2, 64
BLOCK, NUM_BLOCKS = 16, 6
K_SCALE, V_SCALE = 0.05, 0.02
LAYER = "model.layers.0.self_attn.attn"


def _e4m3_error(stored: torch.Tensor, given: torch.Tensor, scale: float) -> float:
    """Worst error of ``stored * scale`` against ``given``, as a fraction of e4m3's
    round-to-nearest bound (2^-4 of the value, 2^-10 of the scale for subnormals)."""
    bound = 2**-4 * given.abs() + 2**-10 * scale
    return ((stored.float() * scale - given).abs() / bound).max().item()


def _gqa_layer(kind: str, checkpoint: dict[str, float] | None) -> nn.Module:
    """What vLLM's ``Attention`` holds of its scales after loading (``checkpoint``:
    the ``k_scale`` / ``v_scale`` tensors a compressed-tensors checkpoint carries)."""
    layer = nn.Module()
    layer.layer_name, layer.kv_cache_dtype, layer.num_kv_heads = LAYER, kind, KV_HEADS
    set_default_quant_scales(layer, register_buffer=True)
    if checkpoint is not None:
        scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
        config = CompressedTensorsConfig({}, [], "dense", kv_cache_scheme=scheme)
        method = CompressedTensorsKVCacheMethod(config)
        method.create_weights(layer)
        for name, value in checkpoint.items():
            getattr(layer, name).data.copy_(torch.tensor([value]))
        method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("kind", ["fp8", "fp8_e4m3"])
@pytest.mark.parametrize("loaded", [True, False], ids=["checkpoint", "vllm-default"])
def test_gqa_pages_take_the_layers_loaded_scales(kind, loaded):
    scales = (K_SCALE, V_SCALE) if loaded else (1.0, 1.0)
    layer = _gqa_layer(kind, dict(k_scale=K_SCALE, v_scale=V_SCALE) if loaded else None)
    assert (layer._k_scale.item(), layer._v_scale.item()) == pytest.approx(scales)
    impl = BridgeAttentionImpl(HEADS, HEAD, HEAD**-0.5, KV_HEADS, kv_cache_dtype=kind)
    generator = torch.Generator().manual_seed(7)
    rows = 20
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=generator)[:rows]
    # Magnitudes a calibration would cover: |x| / scale stays below e4m3's 448.
    query = torch.randn(rows, HEADS, HEAD, generator=generator)
    key, value = (torch.randn(rows, KV_HEADS, HEAD, generator=generator) * 3 * s for s in scales)
    kv_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD, dtype=torch.uint8)
    spec = npu_attention.AttentionSpec(HEADS, KV_HEADS, HEAD, BLOCK, dtype=torch.float32,
                                       kv_cache_dtype=kind)  # fmt: skip
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32)[None, :]
    plan = npu_attention.plan([0, rows], [rows], table, slots, 0, spec, provider="reference")
    out = torch.empty(rows, HEADS, HEAD)
    impl.forward(layer, query, key, value, kv_cache, BridgeAttentionMetadata(plan, rows), out)
    stored = kv_cache[slots // BLOCK, :, slots % BLOCK].view(torch.float8_e4m3fn)
    assert _e4m3_error(stored[..., :HEAD], key, scales[0]) <= 1.0
    assert _e4m3_error(stored[..., HEAD:], value, scales[1]) <= 1.0
    if loaded:  # vLLM's default scale would not have given these rows
        assert _e4m3_error(stored[..., :HEAD], key, 1.0) > 1.0


RANK, NOPE, ROPE, V = 32, 16, 16, 16
MLA_SPEC = dict(num_heads=HEADS, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
                qk_rope_head_dim=ROPE, v_head_dim=V, block_size=BLOCK, dtype=torch.float32)  # fmt: skip


def _mla_layer(checkpoint_k_scale: float | None) -> nn.Module:
    """What vLLM's ``MLAAttention`` holds after loading with a KV-cache method of the
    base kind (ModelOpt's for MLA layers), or with none (vLLM's defaults)."""
    layer = nn.Module()
    layer.layer_name, layer.kv_cache_dtype = LAYER, "fp8"
    set_default_quant_scales(layer, register_buffer=True)
    if checkpoint_k_scale is not None:
        method = BaseKVCacheMethod(quant_config=None)
        method.create_weights(layer)
        layer.k_scale.weight_loader(layer.k_scale, torch.tensor(checkpoint_k_scale))
        method.process_weights_after_loading(layer)
    return layer


def _mla_impl() -> BridgeMLAImpl:
    """The impl's write and decode paths (its projections are vLLM's and unused here)."""
    impl = object.__new__(BridgeMLAImpl)
    impl.kv_cache_split, impl.kv_cache_dtype, impl._layer_name = "packed", "fp8", LAYER
    impl.kv_lora_rank, impl.qk_rope_head_dim, impl.dcp_world_size = RANK, ROPE, 1
    return impl


def _mla_metadata(spec: MLASpec, seq_lens: list[int], slots: torch.Tensor, decode: bool):
    reqs = len(seq_lens)
    queries = [1] * reqs if decode else seq_lens
    cu = [0]
    for count in queries:
        cu.append(cu[-1] + count)
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32).view(reqs, -1)
    plan = npu_attention.plan(cu, seq_lens, table, slots, reqs if decode else 0, spec,
                              provider="reference")  # fmt: skip
    rows = MLARows(reqs, cu[-1])
    return BridgeMLAMetadata(
        plan=plan, num_actual_tokens=cu[-1], num_reqs=reqs, num_decodes=reqs if decode else 0,
        num_decode_tokens=cu[-1] if decode else 0, num_prefills=0 if decode else reqs,
        decode=rows if decode else None, prefill=None if decode else rows,
    )  # fmt: skip


@pytest.mark.parametrize("loaded", [True, False], ids=["checkpoint", "vllm-default"])
def test_mla_latent_pages_take_the_layers_loaded_scale(loaded):
    scale = K_SCALE if loaded else 1.0
    layer = _mla_layer(K_SCALE if loaded else None)
    assert layer._k_scale.item() == pytest.approx(scale)
    spec = MLASpec(**MLA_SPEC, kv_cache_dtype="fp8")
    generator = torch.Generator().manual_seed(11)
    seq_lens = [30, 41]  # two requests, three blocks each
    slots = torch.cat([torch.arange(n) + 3 * BLOCK * i for i, n in enumerate(seq_lens)])
    kv_c = torch.randn(len(slots), RANK, generator=generator) * 3 * scale
    k_pe = torch.randn(len(slots), 1, ROPE, generator=generator) * 3 * scale
    cache = torch.zeros(NUM_BLOCKS, BLOCK, RANK + ROPE, dtype=torch.uint8)
    impl = _mla_impl()
    with set_forward_context({LAYER: _mla_metadata(spec, seq_lens, slots, False)}, VllmConfig()):
        # as vLLM's MLAAttention calls it: the layer's own _k_scale
        impl.do_kv_cache_update(kv_c, k_pe, cache, slots, "fp8", layer._k_scale)
    stored = cache.view(torch.float8_e4m3fn).view(-1, RANK + ROPE)[slots]
    latents = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1)
    assert _e4m3_error(stored, latents, scale) <= 1.0
    if loaded:
        assert _e4m3_error(stored, latents, 1.0) > 1.0

    # One decode token per request over its latents, read with the layer's scale.
    q_latent = torch.randn(2, HEADS, RANK, generator=generator)
    q_rope = torch.randn(2, HEADS, ROPE, generator=generator)
    last = torch.tensor([seq_lens[0] - 1, 3 * BLOCK + seq_lens[1] - 1])
    decode = _mla_metadata(spec, seq_lens, last, True)
    out, _ = impl.forward_mqa((q_latent, q_rope), cache, decode, layer)
    dequantized = cache.view(torch.float8_e4m3fn).float().view(-1, RANK + ROPE) * scale
    for request, n in enumerate(seq_lens):
        keys = dequantized[3 * BLOCK * request : 3 * BLOCK * request + n]
        scores = q_latent[request] @ keys[:, :RANK].T + q_rope[request] @ keys[:, RANK:].T
        weights = torch.softmax(scores * (NOPE + ROPE) ** -0.5, dim=-1)
        torch.testing.assert_close(out[request], weights @ keys[:, :RANK], rtol=1e-4, atol=1e-5)
