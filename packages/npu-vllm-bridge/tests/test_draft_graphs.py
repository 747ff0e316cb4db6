"""The drafter's FULL graphs: padding of its passes and their dispatch keys.

vLLM's proposer builds each pass's ``CommonAttentionMetadata`` unpadded (its
runner calls ``unpadded()`` on what it hands the drafter). Before a FULL replay the
bridge pads a uniform pass to the captured size as vLLM's model runner pads the
target's batch (``GPUModelRunner._build_attention_metadata``): requests of query
length 0 with ``seq_lens`` 0 and null-block rows, slot -1 tokens. The reference here
is vLLM's own layout: a batch padded that way, whose ``unpadded()`` must pad back to
it, and whose plan must give the real requests' attention (float64 reference,
atol 2e-5) with padded requests on the null block only.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from bridge_batches import (
    HEAD_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    make_batch,
    naive_attention,
    packed_kv_cache,
)
from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.forward_context import BatchDescriptor
from vllm.model_executor.layers.attention import Attention
from vllm.v1.kv_cache_interface import FullAttentionSpec

from npu_attention import BatchState
from npu_vllm_bridge.attention.backend import NPUBridgeAttentionBackend
from npu_vllm_bridge.attention.builder import BridgeMetadataBuilder
from npu_vllm_bridge.graphs.draft_graphs import (
    DraftStepBuffers,
    draft_descriptors,
    dummy_uniform_metadata,
    pad_common_metadata,
    padded_descriptor,
    uniform_query_len,
    why_not_graphed,
)

BLOCK_SIZE, NUM_BLOCKS = 16, 64
SCALE = HEAD_SIZE**-0.5
ATOL = 2e-5
K = 2  # speculative tokens: first passes of 1 + K = 3 tokens per request
DRAFT_LAYER = "draft.layers.0.self_attn.attn"


@pytest.fixture(scope="module")
def draft_layer():
    torch.set_default_dtype(torch.float32)
    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK_SIZE))
    config.speculative_config = SimpleNamespace(num_speculative_tokens=K, parallel_drafting=False)
    with set_current_vllm_config(config):
        Attention(
            num_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            scale=SCALE,
            num_kv_heads=NUM_KV_HEADS,
            prefix=DRAFT_LAYER,
            attn_backend=NPUBridgeAttentionBackend,
        )
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    return config, BridgeMetadataBuilder(spec, [DRAFT_LAYER], config, torch.device("cpu"))


def _vllm_padded(batch, num_reqs_padded: int):
    """``batch`` (made with its padding tokens) padded as vLLM's runner pads a graph batch."""
    cm = batch.common
    extra = num_reqs_padded - cm.num_reqs
    cu = torch.cat([cm.query_start_loc_cpu, cm.query_start_loc_cpu[-1:].repeat(extra)])
    seq_lens = torch.cat([cm.seq_lens_cpu_upper_bound, torch.zeros(extra, dtype=torch.int32)])
    width = cm.block_table_tensor.shape[1]
    tables = torch.cat([cm.block_table_tensor, torch.zeros(extra, width, dtype=torch.int32)])
    return cm.replace(
        query_start_loc=cu.clone(),
        query_start_loc_cpu=cu,
        seq_lens=seq_lens.clone(),
        seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=num_reqs_padded,
        block_table_tensor=tables,
    )


@pytest.mark.parametrize("query_len", [1, 1 + K])
@pytest.mark.parametrize("num_real", [4, 3, 1])
def test_padding_equals_vllm_padded_layout(num_real, query_len):
    generator = torch.Generator().manual_seed(60 + num_real + query_len)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    contexts = [37, 5, 64, 18][:num_real]
    pad = 4 - num_real
    batch = make_batch(
        [(c, query_len) for c in contexts], kv_cache, BLOCK_SIZE, generator, query_len * pad
    )
    theirs = _vllm_padded(batch, 4)
    unpadded = theirs.unpadded(query_len * num_real, num_real)  # what the drafter gets
    ours = pad_common_metadata(unpadded, 4, 4 * query_len)
    assert (ours.num_reqs, ours.num_actual_tokens) == (theirs.num_reqs, theirs.num_actual_tokens)
    for field in (
        "query_start_loc",
        "query_start_loc_cpu",
        "seq_lens",
        "seq_lens_cpu_upper_bound",
        "block_table_tensor",
        "slot_mapping",
    ):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    # And back: vLLM's unpadding of our padding is the pass we started from.
    back = ours.unpadded(query_len * num_real, num_real)
    assert torch.equal(back.query_start_loc_cpu, unpadded.query_start_loc_cpu)
    assert torch.equal(back.slot_mapping, unpadded.slot_mapping)


def test_padding_refuses_a_smaller_size():
    cm = dummy_uniform_metadata(3, 1, 4, 128, "cpu")
    with pytest.raises(ValueError, match="cannot pad a batch of 3 requests"):
        pad_common_metadata(cm, 2, 2)


def test_graphed_passes_plan_on_the_tensors_of_their_capture(draft_layer):
    """A graph's attention tasks keep the tensors of their capture (an NPU task update
    changes host arguments only): the capture's dummy batch and two later passes padded
    to its key (3 and 2 real requests of other contexts) plan on the same slot, block
    table and length tensors, each holding the pass's own padded values."""
    _, builder = draft_layer
    buffers = DraftStepBuffers(4, 4)
    capture = builder.build_for_cudagraph_capture(
        buffers.load(dummy_uniform_metadata(4, 1, 4, 128, "cpu"))
    ).plan
    generator = torch.Generator().manual_seed(75)
    for contexts in ([30, 11, 50], [60, 3]):  # 4 blocks of 16 at most, as the capture's
        kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        batch = make_batch([(c, 1) for c in contexts], kv_cache, BLOCK_SIZE, generator)
        expected = pad_common_metadata(batch.common, 4, 4)
        padded = pad_common_metadata(batch.common, 4, 4, buffers)
        for field in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
            assert torch.equal(getattr(padded, field), getattr(expected, field)), field
        plan = builder.build(0, padded).plan
        for name in ("slot_mapping", "block_tables"):
            ours, captured = getattr(plan, name), getattr(capture, name)
            assert ours.data_ptr() == captured.data_ptr(), name
            assert ours.shape == captured.shape, name
        assert torch.equal(plan.block_tables, expected.block_table_tensor)


def test_step_buffers_refuse_a_larger_batch_or_another_table_width():
    buffers = DraftStepBuffers(2, 2)
    buffers.load(dummy_uniform_metadata(2, 1, 4, 128, "cpu"))
    with pytest.raises(ValueError, match="hold 2 requests / 2 tokens, got 3 / 3"):
        buffers.load(dummy_uniform_metadata(3, 1, 4, 128, "cpu"))
    with pytest.raises(ValueError, match=r"block_table buffer is \(4,\) torch.int32"):
        buffers.load(dummy_uniform_metadata(2, 1, 5, 128, "cpu"))


@pytest.mark.parametrize(
    ("query_len", "expected_cu"),
    [(1 + K, [0, 3, 6, 9, 12]), (1, [0, 1, 2, 3, 4])],
)
def test_padded_draft_passes_plan_and_attend(draft_layer, query_len, expected_cu):
    """A first pass (1 + k tokens per request) and the draft steps after it (one token,
    KV one longer each step), 3 real requests padded to 4: offsets in multiples of the
    query length, padded KV lengths on the null block, real rows equal attention."""
    config, builder = draft_layer
    layer = config.compilation_config.static_forward_context[DRAFT_LAYER]
    generator = torch.Generator().manual_seed(70 + query_len)
    contexts = [30, 11, 50]
    steps = [0] if query_len > 1 else [1, 2]  # draft steps: sequences one longer each
    for step in steps:
        kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        kv_cache[0].zero_()  # vLLM's null block
        grown = [c + step for c in contexts]
        batch = make_batch([(c, query_len) for c in grown], kv_cache, BLOCK_SIZE, generator)
        before = kv_cache.clone()
        padded = pad_common_metadata(batch.common, 4, 4 * query_len)
        metadata = builder.build(0, padded)
        plan = metadata.plan
        expected_state = BatchState.SPEC_DECODING if query_len > 1 else BatchState.DECODE_ONLY
        assert plan.state is expected_state
        assert (plan.num_reqs, plan.num_decodes, metadata.num_actual_tokens) == (
            4,
            4,
            4 * query_len,
        )
        assert plan.cu_seqlens_q_host == expected_cu
        assert plan.seq_lens_host == [c + query_len for c in grown] + [query_len]
        assert plan.block_tables[3:].eq(0).all()
        query = torch.cat([batch.query, torch.randn(query_len, NUM_HEADS, HEAD_SIZE)])
        key = torch.cat([batch.key, torch.randn(query_len, NUM_KV_HEADS, HEAD_SIZE)])
        value = torch.cat([batch.value, torch.randn(query_len, NUM_KV_HEADS, HEAD_SIZE)])
        out = torch.full_like(query, float("nan"))
        layer.impl.forward(layer, query, key, value, kv_cache, metadata, out)
        rows = 3 * query_len
        torch.testing.assert_close(
            out[:rows].double(), naive_attention(batch, SCALE), atol=ATOL, rtol=0
        )
        assert torch.isfinite(out[rows:]).all()
        # The padding request's tokens (slot -1) wrote nothing.
        changed = ((kv_cache != before) & ~(kv_cache.isnan() & before.isnan())).any(dim=(1, 2, 3))
        touched = set(torch.nonzero(changed).flatten().tolist())
        assert touched <= set(batch.common.block_table_tensor.flatten().tolist()) - {0}


def test_draft_keys_and_their_padding():
    # Target verify graphs of 1, 2 and 4 requests; k = 2.
    descs = draft_descriptors([1, 2, 4], K, first_pass=True)
    key = lambda t, r: BatchDescriptor(num_tokens=t, num_reqs=r, uniform=True)  # noqa: E731
    assert descs == [key(12, 4), key(6, 2), key(4, 4), key(3, 1), key(2, 2), key(1, 1)]
    # A draft model's first pass (k + 2 tokens per request) is not graphed.
    assert draft_descriptors([1, 2, 4], K, first_pass=False) == [key(4, 4), key(2, 2), key(1, 1)]
    # k = 1 (one MTP layer): no draft steps, first passes of 2 tokens only.
    assert draft_descriptors([1, 2, 4], 1, first_pass=True) == [key(8, 4), key(4, 2), key(2, 1)]
    # 3 requests pad to 4 in both kinds of pass; 5 requests have no graph.
    assert padded_descriptor(descs, 3, 1 + K) == key(12, 4)
    assert padded_descriptor(descs, 3, 1) == key(4, 4)
    assert padded_descriptor(descs, 2, 1) == key(2, 2)
    assert padded_descriptor(descs, 5, 1) is None
    assert padded_descriptor(descs, 1, 2) is None  # no graph of 2-token requests


def test_uniform_query_len_of_passes():
    assert uniform_query_len(dummy_uniform_metadata(3, 1 + K, 4, 128, "cpu")) == 1 + K
    assert uniform_query_len(dummy_uniform_metadata(2, 1, 4, 128, "cpu")) == 1
    generator = torch.Generator().manual_seed(80)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    mixed = make_batch([(10, 3), (4, 1)], kv_cache, BLOCK_SIZE, generator).common
    assert uniform_query_len(mixed) is None
    # Padding tokens beyond the requests' (a padded pass) are not a uniform pass.
    padded = make_batch([(10, 3), (4, 3)], kv_cache, BLOCK_SIZE, generator, pad_tokens=3).common
    assert uniform_query_len(padded) is None


def _spec(method: str, **overrides):
    options = dict(enforce_eager=False, disable_padded_drafter_batch=False)
    return SimpleNamespace(method=method, **{**options, **overrides})


@pytest.mark.parametrize(
    ("method", "overrides", "dp", "reason"),
    [
        ("eagle", {}, 1, None),
        ("draft_model", {}, 1, None),
        ("mtp", {}, 1, None),
        ("eagle3", {}, 1, "asserts the EAGLE-3 head's model class"),
        ("medusa", {}, 1, "method 'medusa' is not one the bridge graphs"),
        ("eagle", {"enforce_eager": True}, 1, "enforce_eager"),
        ("eagle", {"disable_padded_drafter_batch": True}, 1, "disable_padded_drafter_batch"),
        ("mtp", {}, 2, "data parallelism"),
    ],
)
def test_which_drafters_get_full_graphs(method, overrides, dp, reason):
    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp))
    got = why_not_graphed(_spec(method, **overrides), config, ("mtp",))
    if reason is None:
        assert got is None
    else:
        assert reason in got
