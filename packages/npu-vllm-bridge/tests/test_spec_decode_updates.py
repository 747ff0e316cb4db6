"""The step state of speculative decoding, against the batches vLLM 0.32 builds.

Verify step (``GPUModelRunner._build_attention_metadata`` for a uniform decode batch
padded to a captured size): ``1 + k`` query tokens per real request; padded requests
have ``query_start_loc`` repeating the last offset, ``seq_lens`` 0, block-table rows of
the null block and slot -1. The bridge's plan (what the attention tasks are updated
with before a replay) must have cumulative query offsets in multiples of ``1 + k`` up
to the padded token count, the real requests' KV lengths, and padded requests that
attend only the null block.

Draft steps (``SpecDecodeBaseProposer.propose`` with a padded drafter batch): the
first pass carries the verify layout; each later pass one query token per request,
``seq_lens`` one longer each time, lowered on the device only by the tokens the
verify step rejected (the host ``seq_lens_cpu_upper_bound`` stays an upper bound).
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
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.kv_cache_interface import FullAttentionSpec

from npu_attention import BatchState
from npu_vllm_bridge.attention.backend import NPUBridgeAttentionBackend
from npu_vllm_bridge.attention.builder import (
    BridgeMetadataBuilder,
    count_leading_decodes,
    fill_padding_requests,
    host_query_and_seq_lens,
)

BLOCK_SIZE, NUM_BLOCKS = 16, 64
SCALE = HEAD_SIZE**-0.5
ATOL = 2e-5
K = 2  # speculative tokens: verify requests bring 1 + K = 3 query tokens


def _spec_config(k: int = K) -> VllmConfig:
    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK_SIZE))
    # What the builder reads of vLLM's SpeculativeConfig (a real one needs a model).
    config.speculative_config = SimpleNamespace(num_speculative_tokens=k, parallel_drafting=False)
    return config


@pytest.fixture(scope="module")
def spec_layers():
    torch.set_default_dtype(torch.float32)
    config = _spec_config()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    with set_current_vllm_config(config):
        for name in names:
            Attention(
                num_heads=NUM_HEADS,
                head_size=HEAD_SIZE,
                scale=SCALE,
                num_kv_heads=NUM_KV_HEADS,
                prefix=name,
                attn_backend=NPUBridgeAttentionBackend,
            )
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    return config, names, BridgeMetadataBuilder(spec, names, config, torch.device("cpu"))


def _run_layer(config, name, batch, kv_cache, metadata) -> torch.Tensor:
    layer = config.compilation_config.static_forward_context[name]
    out = torch.full_like(batch.query, float("nan"))
    layer.impl.forward(layer, batch.query, batch.key, batch.value, kv_cache, metadata, out)
    return out


def _pad_like_vllm(batch, num_reqs_padded: int, num_tokens_padded: int):
    """Pad a batch as vLLM pads a uniform decode batch for a FULL graph."""
    cm = batch.common
    num_reqs = cm.num_reqs
    extra = num_reqs_padded - num_reqs
    cu = torch.cat([cm.query_start_loc_cpu, cm.query_start_loc_cpu[-1:].repeat(extra)])
    seq_lens = torch.cat([cm.seq_lens_cpu_upper_bound, torch.zeros(extra, dtype=torch.int32)])
    tables = torch.cat(
        [
            cm.block_table_tensor,
            torch.zeros(extra, cm.block_table_tensor.shape[1], dtype=torch.int32),
        ]
    )
    assert cm.num_actual_tokens == num_tokens_padded  # make_batch's pad_tokens: slot -1 rows
    batch.common = cm.replace(
        query_start_loc=cu.clone(),
        query_start_loc_cpu=cu,
        seq_lens=seq_lens.clone(),
        seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=num_reqs_padded,
        block_table_tensor=tables,
    )
    return batch


def test_builder_serves_verify_steps_as_uniform_decodes(spec_layers):
    config, _, builder = spec_layers
    assert builder.reorder_batch_threshold == 1 + K
    assert builder.spec.num_speculative_tokens == K
    support = BridgeMetadataBuilder.get_cudagraph_support(config, None)
    assert support is AttentionCGSupport.UNIFORM_BATCH
    # Without a drafter, single-token decodes only (unchanged).
    assert (
        BridgeMetadataBuilder.get_cudagraph_support(VllmConfig(), None)
        is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )


@pytest.mark.parametrize("num_real", [4, 3, 1])
def test_padded_verify_step_offsets_and_kv_lengths(spec_layers, num_real):
    """4 captured requests of 1 + k tokens (12 tokens); ``4 - num_real`` are padding."""
    config, names, builder = spec_layers
    generator = torch.Generator().manual_seed(20 + num_real)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    kv_cache[0].zero_()  # vLLM's null block
    contexts = [37, 5, 64, 18][:num_real]
    pad = 4 - num_real
    batch = make_batch(
        [(c, 1 + K) for c in contexts], kv_cache, BLOCK_SIZE, generator, pad_tokens=(1 + K) * pad
    )
    batch = _pad_like_vllm(batch, 4, 4 * (1 + K))
    before = kv_cache.clone()
    metadata = builder.build(0, batch.common)
    plan = metadata.plan
    assert plan.state is BatchState.SPEC_DECODING
    assert (plan.num_reqs, plan.num_decodes, metadata.num_actual_tokens) == (4, 4, 12)
    # Cumulative query offsets in multiples of 1 + k, to the padded token count.
    assert plan.cu_seqlens_q_host == [0, 3, 6, 9, 12]
    assert plan.actual_seq_lengths_q == [3, 6, 9, 12]
    # KV lengths: context + 1 + k for real requests; padded ones attend 1 + k keys of
    # the null block only (their rows are discarded), never a real request's pages.
    assert plan.seq_lens_host == [c + 1 + K for c in contexts] + [1 + K] * pad
    assert plan.block_tables[num_real:].eq(0).all()
    out = _run_layer(config, names[0], batch, kv_cache, metadata)
    rows = (1 + K) * num_real
    batch.requests = [(c, 1 + K) for c in contexts]
    torch.testing.assert_close(
        out[:rows].double(), naive_attention(batch, SCALE)[:rows], atol=ATOL, rtol=0
    )
    assert torch.isfinite(out[rows:]).all()
    # Padding tokens (slot -1) wrote nothing: only real requests' blocks changed.
    changed = ((kv_cache != before) & ~(kv_cache.isnan() & before.isnan())).any(dim=(1, 2, 3))
    touched = set(torch.nonzero(changed).flatten().tolist())
    real_blocks = set(batch.common.block_table_tensor[:num_real].flatten().tolist()) - {0}
    assert touched <= real_blocks


def test_partial_drafts_are_decodes_and_prefills_follow(spec_layers):
    """ngram proposes 0..k tokens per request: verify requests of 1..1+k tokens are all
    decodes (vLLM's reorder puts them first); a prefill after them is not."""
    config, names, builder = spec_layers
    generator = torch.Generator().manual_seed(31)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    requests = [(20, 3), (9, 1), (40, 2), (0, 17)]
    batch = make_batch(requests, kv_cache, BLOCK_SIZE, generator)
    metadata = builder.build(0, batch.common)
    assert metadata.plan.state is BatchState.CHUNKED_PREFILL
    assert metadata.plan.num_decodes == 3
    out = _run_layer(config, names[1], batch, kv_cache, metadata)
    torch.testing.assert_close(out.double(), naive_attention(batch, SCALE), atol=ATOL, rtol=0)


def test_draft_steps_grow_by_one_and_read_exact_seq_lens(spec_layers):
    """The EAGLE drafter's passes after the first: one query token per request, KV
    lengths one longer each pass, minus the rejected tokens on the device only."""
    config, names, builder = spec_layers
    generator = torch.Generator().manual_seed(41)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    contexts, rejected = [30, 11, 50], [2, 0, 1]
    for draft_step in range(1, K + 1):
        # After the verify step each request's sequence is context + 1 + k long, less
        # what was rejected; draft pass j appends one more token.
        true_contexts = [c + 1 + K - r + draft_step - 1 for c, r in zip(contexts, rejected)]
        batch = make_batch([(c, 1) for c in true_contexts], kv_cache, BLOCK_SIZE, generator)
        cm = batch.common
        optimistic = cm.seq_lens + torch.tensor(rejected, dtype=torch.int32)
        batch.common = cm.replace(seq_lens_cpu_upper_bound=optimistic)
        query_lens, seq_lens = host_query_and_seq_lens(batch.common, exact=True)
        assert query_lens == [1, 1, 1]
        assert seq_lens == [c + 1 for c in true_contexts]
        assert host_query_and_seq_lens(batch.common)[1] == optimistic.tolist()  # the bound
        metadata = builder.build(0, batch.common)
        assert metadata.plan.state is BatchState.DECODE_ONLY
        assert metadata.plan.seq_lens_host == seq_lens
        out = _run_layer(config, names[0], batch, kv_cache, metadata)
        torch.testing.assert_close(out.double(), naive_attention(batch, SCALE), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("query_lens", "num_tokens", "decode_len", "expected_q", "expected_kv"),
    [
        # verify step padded from 2 to 4 requests of 3 tokens
        ([3, 3, 0, 0], 12, 3, [3, 3, 3, 3], [40, 7, 3, 3]),
        # draft pass after the first (one token per request) padded to 4 requests
        ([1, 1, 0, 0], 4, 3, [1, 1, 1, 1], [40, 7, 1, 1]),
        # tokens spare for fewer than 1 + k per padded request: one each
        ([3, 3, 0, 0], 9, 3, [3, 3, 1, 1], [40, 7, 1, 1]),
        # no padding requests: unchanged
        ([3, 2], 6, 3, [3, 2], [40, 7]),
        # without speculation: single-token decodes (the existing behaviour)
        ([1, 1, 0], 3, 1, [1, 1, 1], [40, 7, 1]),
    ],
)
def test_fill_padding_requests(query_lens, num_tokens, decode_len, expected_q, expected_kv):
    seq_lens = [40, 7] + [0] * (len(query_lens) - 2)
    fill_padding_requests(query_lens, seq_lens, num_tokens, decode_len)
    assert (query_lens, seq_lens) == (expected_q, expected_kv)


def test_count_leading_decodes():
    assert count_leading_decodes([1, 1, 5, 1]) == 2
    assert count_leading_decodes([3, 1, 2, 5, 1], max_decode_len=3) == 3
    assert count_leading_decodes([3, 3], max_decode_len=1) == 0
    assert count_leading_decodes([0, 1], max_decode_len=3) == 0
