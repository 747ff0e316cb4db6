"""The bridge's attention layer on the ascend provider, with the inputs vLLM gives it.

- vLLM's dummy runs (warm-up, profile, graph capture) give every token slot ``-1``. The
  capture must record the KV write a replay's task update re-issues: the bridge plans
  with ``slot_handling="device"``, so the write takes every token and sends the padding
  into vLLM's null block (block 0), never a ``-1`` slot to ``npu_scatter_pa_kv_cache``.
- vLLM's value is a strided view of the QKV projection's output: the bridge's impl
  copies it before the attention task (where a graph records the copy as its own op),
  not the provider inside the task. Its output equals the reference provider's.
"""

from __future__ import annotations

import pytest
import torch
from ascend_cases import DTYPE_TOLERANCE, max_error
from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

import npu_vllm_bridge.attention.impl as impl_module
from npu_attention import register_provider
from npu_vllm_bridge.attention.backend import NPUBridgeAttentionBackend
from npu_vllm_bridge.attention.builder import BridgeMetadataBuilder

ASCEND_TARGET = "npu_attention.providers.ascend:AscendProvider"
HEADS, KV_HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 8, 2, 128, 128, 6
DTYPE = torch.float16
SCATTER = "npu_scatter_pa_kv_cache"
NAME = "model.layers.0.self_attn.attn"


@pytest.fixture
def host_ascend():
    register_provider("ascend", "ascend_cases:HostAscendProvider")
    yield "ascend"
    register_provider("ascend", ASCEND_TARGET)


@pytest.fixture(scope="module")
def layer_config() -> VllmConfig:
    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK))
    with set_current_vllm_config(config):
        Attention(
            num_heads=HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5, num_kv_heads=KV_HEADS,
            prefix=NAME, attn_backend=NPUBridgeAttentionBackend,
        )  # fmt: skip
    return config


def _builder(config: VllmConfig, provider: str) -> BridgeMetadataBuilder:
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE
    )
    builder = BridgeMetadataBuilder(spec, [NAME], config, torch.device("cpu"))
    builder.provider = provider
    return builder


def _decodes(seq_lens: list[int], slots: list[int], tables: torch.Tensor):
    n = len(seq_lens)
    cu = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=cu.clone(), query_start_loc_cpu=cu, seq_lens=lens.clone(),
        seq_lens_cpu_upper_bound=lens, num_reqs=n, num_actual_tokens=n, max_query_len=1,
        max_seq_len=int(lens.max()), block_table_tensor=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )  # fmt: skip


def _forward(config, metadata, query, key, value, kv_cache, monkeypatch) -> torch.Tensor:
    layer = config.compilation_config.static_forward_context[NAME]
    monkeypatch.setattr(layer.impl, "kv_cache_split", "planes")  # the NPU platform's
    out = torch.zeros_like(query)
    layer.impl.forward(layer, query, key, value, kv_cache, metadata, out)
    return out


def _kv_cache() -> torch.Tensor:
    return torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_SIZE, dtype=DTYPE)


def test_capture_of_a_dummy_run_writes_every_token_into_the_null_block(
    stand_in, host_ascend, layer_config, monkeypatch
) -> None:
    """Three dummy decodes (slot -1, block-table rows on the null block), planned for
    capture: the write the graph records takes all three rows, into block 0."""
    common = _decodes([1, 1, 1], [-1, -1, -1], torch.zeros(3, 2, dtype=torch.int32))
    metadata = _builder(layer_config, host_ascend).build_for_cudagraph_capture(common)
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(3, HEADS, HEAD_SIZE, generator=generator).to(DTYPE)
    key = torch.randn(3, KV_HEADS, HEAD_SIZE, generator=generator).to(DTYPE)
    kv_cache = _kv_cache()
    _forward(layer_config, metadata, query, key, key.clone(), kv_cache, monkeypatch)
    (scatter,) = stand_in.log.of(SCATTER)
    assert scatter.arguments["slot_mapping"].tolist() == [0, 1, 2]
    assert scatter.arguments["key"].shape[0] == 3
    key_plane = kv_cache.flatten()[: kv_cache.numel() // 2].view(NUM_BLOCKS, BLOCK, KV_HEADS, -1)
    assert torch.equal(key_plane[0, :3], key)
    assert not key_plane[1:].any()  # no request's block touched


def test_impl_copies_a_strided_value_before_the_attention_task(
    stand_in, host_ascend, layer_config, monkeypatch
) -> None:
    generator = torch.Generator().manual_seed(4)
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    seq_lens = [200, 17]
    slots = [2 * BLOCK + 71, 3 * BLOCK + 16]
    common = _decodes(seq_lens, slots, tables)
    width = (HEADS + 2 * KV_HEADS) * HEAD_SIZE
    qkv = torch.randn(2, width, generator=generator).to(DTYPE)  # one projection's rows
    kv_width = KV_HEADS * HEAD_SIZE
    query, key, value = qkv.split([HEADS * HEAD_SIZE, kv_width, kv_width], dim=-1)
    query = query.reshape(2, HEADS, HEAD_SIZE)
    key = key.reshape(2, KV_HEADS, HEAD_SIZE)
    value = value.view(2, KV_HEADS, HEAD_SIZE)
    assert not value.is_contiguous()
    cache = torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_SIZE, generator=generator)
    seen: list[bool] = []
    run_attention = impl_module.run_attention

    def recording_run_attention(query, key, value, *args, **kwargs):
        seen.append(all(t.is_contiguous() for t in (query, key, value)))
        return run_attention(query, key, value, *args, **kwargs)

    monkeypatch.setattr(impl_module, "run_attention", recording_run_attention)
    outputs = {}
    for provider in (host_ascend, "reference"):
        metadata = _builder(layer_config, provider).build(0, common)
        kv_cache = cache.to(DTYPE)
        outputs[provider] = _forward(
            layer_config, metadata, query, key, value, kv_cache, monkeypatch
        )
    assert seen[0], "the ascend provider's task got a strided tensor"
    assert stand_in.log.of(SCATTER)
    error = max_error(outputs[host_ascend], outputs["reference"])
    assert error < DTYPE_TOLERANCE[DTYPE], error
