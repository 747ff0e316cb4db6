"""The bridge's builder and impl on vLLM-style batches, against naive dense attention.

Each case builds real ``CommonAttentionMetadata`` (decodes first, as vLLM's reorder
leaves them), runs the builder and the impl of real vLLM ``Attention`` layers, and
compares with float64 attention over the raw K/V (tolerance 2e-5 for float32).
"""

from __future__ import annotations

import pytest
import torch
from bridge_batches import (
    HEAD_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    kv_views,
    make_batch,
    naive_attention,
    packed_kv_cache,
)
from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm_builds import needs_vllm_cpu_platform

from npu_attention import BatchState
from npu_vllm_bridge.attention.backend import NPUBridgeAttentionBackend
from npu_vllm_bridge.attention.builder import BridgeMetadataBuilder
from npu_vllm_bridge.attention.kv_cache import split_kv_cache

BLOCK_SIZE = 16
NUM_BLOCKS = 64
SCALE = HEAD_SIZE**-0.5
ATOL = 2e-5


def _layers(sliding_window: int | None = None) -> tuple[VllmConfig, list[str]]:
    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK_SIZE))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    with set_current_vllm_config(config):
        for name in names:
            Attention(
                num_heads=NUM_HEADS,
                head_size=HEAD_SIZE,
                scale=SCALE,
                num_kv_heads=NUM_KV_HEADS,
                prefix=name,
                per_layer_sliding_window=sliding_window,
                attn_backend=NPUBridgeAttentionBackend,
            )
    return config, names


def _builder(config: VllmConfig, names: list[str], sliding_window=None) -> BridgeMetadataBuilder:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float32,
        sliding_window=sliding_window,
    )
    return BridgeMetadataBuilder(spec, names, config, torch.device("cpu"))


@pytest.fixture(scope="module")
def model_layers():
    torch.set_default_dtype(torch.float32)
    return _layers()


def _run_layer(config, name, batch, kv_cache, metadata) -> torch.Tensor:
    layer = config.compilation_config.static_forward_context[name]
    out = torch.full_like(batch.query, float("nan"))
    layer.impl.forward(layer, batch.query, batch.key, batch.value, kv_cache, metadata, out)
    return out


BATCHES = {
    "decode": [(37, 1), (5, 1), (64, 1), (0, 1)],
    "prefill": [(0, 23), (0, 40), (0, 1)],
    "mixed": [(20, 1), (33, 1), (0, 17), (12, 30)],
    "prefix_hit": [(48, 20), (32, 3)],
}
STATES = {
    "decode": BatchState.DECODE_ONLY,
    "prefill": BatchState.PREFILL_NO_CACHE,
    "mixed": BatchState.CHUNKED_PREFILL,
    "prefix_hit": BatchState.PREFILL_CACHE_HIT,
}


@pytest.mark.parametrize(
    ("physical", "split"), [("LBNHC", "packed"), ("LBHNC", "packed"), ("LBNHC", "planes")]
)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_builder_and_impl_match_naive_attention(model_layers, kind, physical, split, monkeypatch):
    config, names = model_layers
    for name in names:
        layer = config.compilation_config.static_forward_context[name]
        monkeypatch.setattr(layer.impl, "kv_cache_split", split)
    generator = torch.Generator().manual_seed(list(BATCHES).index(kind) * 3 + len(physical + split))
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE, physical)
    batch = make_batch(BATCHES[kind], kv_cache, BLOCK_SIZE, generator, split=split)
    metadata = _builder(config, names).build(0, batch.common)
    assert metadata.plan.state is STATES[kind]
    assert metadata.plan.num_decodes == sum(
        1 for _, q in BATCHES[kind] if q == 1 and kind != "prefill"
    )
    out = _run_layer(config, names[0], batch, kv_cache, metadata)
    torch.testing.assert_close(out.double(), naive_attention(batch, SCALE), atol=ATOL, rtol=0)
    # The step's K/V landed in the cache at the slots vLLM gave.
    key_cache, value_cache = kv_views(kv_cache, split)
    slots = batch.common.slot_mapping
    written_k = key_cache.reshape(-1, NUM_KV_HEADS, HEAD_SIZE)[slots]
    written_v = value_cache.reshape(-1, NUM_KV_HEADS, HEAD_SIZE)[slots]
    torch.testing.assert_close(written_k, batch.key)
    torch.testing.assert_close(written_v, batch.value)


def test_sliding_window_layers_match_naive_attention():
    config, names = _layers(sliding_window=8)
    generator = torch.Generator().manual_seed(3)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    batch = make_batch([(30, 1), (0, 25), (19, 6)], kv_cache, BLOCK_SIZE, generator)
    builder = _builder(config, names, sliding_window=8)
    assert builder.spec.sliding_window == 8
    out = _run_layer(config, names[1], batch, kv_cache, builder.build(0, batch.common))
    torch.testing.assert_close(
        out.double(), naive_attention(batch, SCALE, sliding_window=8), atol=ATOL, rtol=0
    )


def test_graph_padded_decode_batch_becomes_uniform_decode(model_layers):
    """FULL-graph padding: zero-length requests on the null block and slot -1 tokens."""
    config, names = model_layers
    generator = torch.Generator().manual_seed(5)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    kv_cache[0].zero_()  # vLLM's null block
    batch = make_batch([(10, 1), (20, 1)], kv_cache, BLOCK_SIZE, generator, pad_tokens=2)
    common = batch.common
    padded = common.replace(
        query_start_loc_cpu=torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor([11, 21, 0, 0], dtype=torch.int32),
        num_reqs=4,
        block_table_tensor=torch.cat(
            [common.block_table_tensor, torch.zeros_like(common.block_table_tensor)]
        ),
    )
    metadata = _builder(config, names).build(0, padded)
    plan = metadata.plan
    assert (plan.state, plan.num_reqs, plan.num_decodes) == (BatchState.DECODE_ONLY, 4, 4)
    assert plan.seq_lens_host == [11, 21, 1, 1]
    before = kv_cache.clone()
    out = _run_layer(config, names[0], batch, kv_cache, metadata)
    torch.testing.assert_close(
        out[:2].double(), naive_attention(batch, SCALE)[:2], atol=ATOL, rtol=0
    )
    # Padding tokens (slot -1) wrote nothing.
    changed = (kv_cache != before) & ~(torch.isnan(kv_cache) & torch.isnan(before))
    assert int(changed.any(dim=(1, 2, 3)).sum()) <= 2  # only the two real requests' blocks


def test_plan_reads_vllms_device_lengths_unless_the_bridge_changed_them(model_layers):
    """vLLM's runner uploads ``query_start_loc`` and ``seq_lens`` every step: the plan takes
    views of them. A padded graph batch, whose lengths the bridge rewrites, gets its own."""
    config, names = model_layers
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    batch = make_batch([(10, 1), (0, 7)], kv_cache, BLOCK_SIZE, torch.Generator().manual_seed(9))
    plan = _builder(config, names).build(0, batch.common).plan
    assert plan.cu_seqlens_q.data_ptr() == batch.common.query_start_loc.data_ptr()
    assert plan.seq_lens.data_ptr() == batch.common.seq_lens.data_ptr()
    assert plan.context_lens.tolist() == [10, 0]
    decodes = make_batch([(10, 1), (20, 1)], kv_cache, BLOCK_SIZE, torch.Generator(), pad_tokens=2)
    padded = decodes.common.replace(
        query_start_loc=torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32),
        seq_lens=torch.tensor([11, 21, 0, 0], dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor([11, 21, 0, 0], dtype=torch.int32),
        num_reqs=4,
        block_table_tensor=torch.zeros(4, 2, dtype=torch.int32),
    )
    plan = _builder(config, names).build(0, padded).plan
    assert plan.seq_lens.data_ptr() != padded.seq_lens.data_ptr()
    assert plan.seq_lens.tolist() == [11, 21, 1, 1]
    assert plan.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]


def _capture_metadata(model_layers):
    """The capture build of three one-token decodes whose block tables hold 8 blocks."""
    config, names = model_layers
    generator = torch.Generator().manual_seed(7)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    batch = make_batch([(0, 1)] * 3, kv_cache, BLOCK_SIZE, generator)
    common = batch.common.replace(block_table_tensor=torch.zeros(3, 8, dtype=torch.int32))
    return _builder(config, names).build_for_cudagraph_capture(common)


@needs_vllm_cpu_platform
def test_capture_build_plans_the_longest_context(model_layers):
    metadata = _capture_metadata(model_layers)
    assert metadata.plan.seq_lens_host == [8 * BLOCK_SIZE] * 3
    assert metadata.plan.state is BatchState.DECODE_ONLY


def test_host_platform_captures_with_vllm_dummy_lengths(model_layers, monkeypatch):
    """Host graphs re-run attention tasks with each step's plan, so the host platform's
    captures keep vLLM's short dummy contexts (the NPU's plan the longest, above)."""
    from vllm.platforms import current_platform

    from npu_vllm_bridge.host.platform import HostPlatform

    assert HostPlatform.bridge_settings.capture_longest_context is False
    monkeypatch.setattr(
        type(current_platform), "bridge_settings", HostPlatform.bridge_settings, raising=False
    )
    metadata = _capture_metadata(model_layers)
    assert metadata.plan.seq_lens_host == [1] * 3


def test_builder_declares_reorder_and_graph_support(model_layers):
    config, names = model_layers
    builder = _builder(config, names)
    assert builder.reorder_batch_threshold == 1
    support = BridgeMetadataBuilder.get_cudagraph_support(config, None)
    assert support is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_profiling_run_without_metadata_leaves_output(model_layers):
    config, names = model_layers
    layer = config.compilation_config.static_forward_context[names[0]]
    query = torch.randn(5, NUM_HEADS, HEAD_SIZE)
    out = torch.zeros_like(query)
    kv = packed_kv_cache(4, BLOCK_SIZE)
    key = torch.randn(5, NUM_KV_HEADS, HEAD_SIZE)
    assert layer.impl.forward(layer, query, key, key, kv, None, out) is out
    assert not out.any()


def test_split_kv_cache_views_share_storage():
    kv_cache = packed_kv_cache(3, BLOCK_SIZE)
    key_cache, value_cache = split_kv_cache(kv_cache, HEAD_SIZE)
    assert key_cache.shape == value_cache.shape == (3, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    assert key_cache.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
    key_cache[1, 2, 0].fill_(7.0)
    assert torch.equal(kv_cache[1, 0, 2, :HEAD_SIZE], torch.full((HEAD_SIZE,), 7.0))
    value_cache[2, 5, 1].fill_(3.0)
    assert torch.equal(kv_cache[2, 1, 5, HEAD_SIZE:], torch.full((HEAD_SIZE,), 3.0))


def test_planes_split_is_contiguous_and_covers_the_region():
    kv_cache = packed_kv_cache(3, BLOCK_SIZE)
    key_cache, value_cache = split_kv_cache(kv_cache, HEAD_SIZE, "planes")
    assert key_cache.shape == value_cache.shape == (3, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    kv_cache.zero_()
    key_cache.fill_(1.0)
    value_cache.fill_(2.0)
    # K and V tile the layer's region exactly: half ones, half twos, nothing left.
    assert int((kv_cache == 1.0).sum()) == int((kv_cache == 2.0).sum()) == kv_cache.numel() // 2


def test_planes_split_refuses_a_cache_that_is_not_one_region():
    strided = torch.zeros(4, NUM_KV_HEADS, BLOCK_SIZE, 4 * HEAD_SIZE)[..., : 2 * HEAD_SIZE]
    with pytest.raises(ValueError, match="one dense region"):
        split_kv_cache(strided, HEAD_SIZE, "planes")
    with pytest.raises(ValueError, match=r"split must be one of \('packed', 'planes'\)"):
        split_kv_cache(packed_kv_cache(2, BLOCK_SIZE), HEAD_SIZE, "interleaved")


def test_split_kv_cache_rejects_wrong_shape():
    with pytest.raises(ValueError, match=r"2 \* head_size.*got shape \(3, 2, 16, 64\)"):
        split_kv_cache(torch.zeros(3, 2, 16, 64), HEAD_SIZE)
    with pytest.raises(ValueError, match="got shape"):
        split_kv_cache(torch.zeros(2, 16, 128), HEAD_SIZE)


def test_backend_class_declarations():
    backend = NPUBridgeAttentionBackend
    assert backend.get_name() == "CUSTOM"
    assert backend.supports_head_size(32) and backend.supports_head_size(112)
    assert not backend.supports_head_size(48)
    assert backend.supports_dtype(torch.float32) and backend.supports_dtype(torch.bfloat16)
    for kind in ("auto", "fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head"):
        assert backend.supports_kv_cache_dtype(kind), kind
    assert not backend.supports_kv_cache_dtype("fp8_e5m2")
    assert not backend.supports_kv_cache_dtype("int4_per_token_head")
    assert backend.supports_block_size(128) and not backend.supports_block_size(8)
    assert backend.supports_attn_type("decoder") and not backend.supports_attn_type("encoder_only")
    assert [layout.name for layout in backend.supported_kv_cache_layouts()] == ["LBNHC"]
