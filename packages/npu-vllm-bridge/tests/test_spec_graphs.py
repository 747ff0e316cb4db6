"""Host graphs of speculative decoding: the target's verify step and the drafter's
steps, each model in its own ``BridgeGraphWrapper`` with its own task registry.

The target (one attention layer) replays a FULL graph of 4 requests x (1 + k) query
tokens; the drafter (one attention layer, its own KV pages) replays a FULL graph of
4 requests x 1 token, k times per step, its query positions and KV lengths one
longer each time. Every replay must equal the eager forward of the same step, and a
draft step whose registry update is skipped must be caught: its replay reads the
previous draft step's plan.
"""

from __future__ import annotations

import itertools

import torch
from bridge_batches import HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, make_batch, packed_kv_cache
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import BatchDescriptor, set_forward_context

import npu_attention
from npu_vllm_bridge.attention.builder import (
    BridgeAttentionMetadata,
    count_leading_decodes,
    cumulative,
    fill_padding_requests,
)
from npu_vllm_bridge.attention.kv_cache import split_kv_cache
from npu_vllm_bridge.attention.tasks import run_attention
from npu_vllm_bridge.graphs.wrapper import BridgeGraphWrapper

BLOCK_SIZE, NUM_BLOCKS, NUM_REQS, K = 16, 96, 4, 2
SPEC = npu_attention.AttentionSpec(
    NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, num_speculative_tokens=K
)
ATOL = 2e-5
TARGET, DRAFT = "model.layers.0.self_attn.attn", "draft.layers.0.self_attn.attn"
# Per step: context lengths of the 4 requests before the verify step (None: padding).
STEPS = [(40, 3, 77, 15), (43, 6, 80, 18), (9, 60, 2, None)]


class _OneLayer(torch.nn.Module):
    """A model of one attention layer named ``name`` over fixed input buffers."""

    def __init__(self, name: str, num_tokens: int, kv_cache: torch.Tensor):
        super().__init__()
        self.name, self.caches = name, split_kv_cache(kv_cache, HEAD_SIZE)
        self.query = torch.zeros(num_tokens, NUM_HEADS, HEAD_SIZE)
        self.key = torch.zeros(num_tokens, NUM_KV_HEADS, HEAD_SIZE)
        self.value = torch.zeros(num_tokens, NUM_KV_HEADS, HEAD_SIZE)

    def load(self, batch) -> None:
        self.query.copy_(batch.query)
        self.key.copy_(batch.key)
        self.value.copy_(batch.value)

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        per_layer = get_forward_context().attn_metadata
        out = torch.empty_like(self.query)
        run_attention(
            self.query * scale,
            self.key,
            self.value,
            *self.caches,
            out,
            per_layer[self.name],
            layer_name=self.name,
        )
        return out * 1.0


def _metadata(batch, num_tokens: int, decode_len: int) -> BridgeAttentionMetadata:
    """The builder's plan of a (padded) batch, as ``BridgeMetadataBuilder._build`` makes it."""
    cm = batch.common
    cu = cm.query_start_loc_cpu.tolist()
    query_lens = [b - a for a, b in itertools.pairwise(cu)]
    seq_lens = cm.seq_lens_cpu_upper_bound.tolist()
    fill_padding_requests(query_lens, seq_lens, num_tokens, decode_len)
    plan = npu_attention.plan(
        cumulative(query_lens),
        seq_lens,
        cm.block_table_tensor,
        cm.slot_mapping,
        count_leading_decodes(query_lens, 1 + K),
        SPEC,
        provider="reference",
    )
    return BridgeAttentionMetadata(plan, num_tokens)


def _batch(requests, kv_cache, generator, query_len: int):
    """A uniform batch of ``NUM_REQS`` requests padded as vLLM pads it (zero-length
    requests on the null block, slot -1 tokens), block tables 8 wide."""
    real = [(c, query_len) for c in requests if c is not None]
    pad = NUM_REQS - len(real)
    batch = make_batch(real, kv_cache, BLOCK_SIZE, generator, pad_tokens=query_len * pad)
    cm = batch.common
    tables = torch.zeros(NUM_REQS, 8, dtype=torch.int32)
    tables[: len(real), : cm.block_table_tensor.shape[1]] = cm.block_table_tensor
    cu = torch.cat([cm.query_start_loc_cpu, cm.query_start_loc_cpu[-1:].repeat(pad)])
    seq_lens = torch.cat([cm.seq_lens_cpu_upper_bound, torch.zeros(pad, dtype=torch.int32)])
    batch.common = cm.replace(
        query_start_loc_cpu=cu,
        seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=NUM_REQS,
        block_table_tensor=tables,
    )
    return batch


class _SpecModels:
    """Target and drafter, each wrapped for FULL graphs with its own task registry."""

    def __init__(self, seed: int):
        self.config = VllmConfig()
        self.generator = torch.Generator().manual_seed(seed)
        self.target_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        self.draft_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        for cache in (self.target_cache, self.draft_cache):
            cache[0].zero_()  # vLLM's null block
        verify_tokens = NUM_REQS * (1 + K)
        self.target = _OneLayer(TARGET, verify_tokens, self.target_cache)
        self.draft = _OneLayer(DRAFT, NUM_REQS, self.draft_cache)
        self.target_graphs = BridgeGraphWrapper(
            self.target, self.config, CUDAGraphMode.FULL, num_attention_layers=1,
            graph_backend="host",
        )  # fmt: skip
        self.draft_graphs = BridgeGraphWrapper(
            self.draft, self.config, CUDAGraphMode.FULL, num_attention_layers=1,
            graph_backend="host",
        )  # fmt: skip
        self.verify_key = BatchDescriptor(num_tokens=verify_tokens, num_reqs=NUM_REQS, uniform=True)
        self.draft_key = BatchDescriptor(num_tokens=NUM_REQS, num_reqs=NUM_REQS, uniform=True)
        self.scale = torch.ones(())

    def verify(self, contexts):
        batch = _batch(contexts, self.target_cache, self.generator, 1 + K)
        self.target.load(batch)
        per_layer = {TARGET: _metadata(batch, NUM_REQS * (1 + K), 1 + K)}
        return per_layer, self._run(self.target_graphs, per_layer, self.verify_key)

    def draft_step(self, contexts, index: int):
        """Draft pass ``index`` (1..k): one token per request, ``index`` beyond the
        verified sequence."""
        grown = [None if c is None else c + 1 + K + index - 1 for c in contexts]
        batch = _batch(grown, self.draft_cache, self.generator, 1)
        self.draft.load(batch)
        per_layer = {DRAFT: _metadata(batch, NUM_REQS, 1 + K)}
        return per_layer

    def _run(self, wrapper, per_layer, key):
        with set_forward_context(
            per_layer, self.config, cudagraph_runtime_mode=CUDAGraphMode.FULL,
            batch_descriptor=key,
        ):  # fmt: skip
            graph_out = wrapper(self.scale).clone()
        with set_forward_context(per_layer, self.config):
            eager_out = wrapper(self.scale)
        return graph_out, eager_out


def _real_rows(contexts, per_request: int) -> int:
    return per_request * sum(c is not None for c in contexts)


def test_verify_and_draft_graphs_replay_with_their_own_registries():
    models = _SpecModels(seed=51)
    assert models.target_graphs.tasks is not models.draft_graphs.tasks
    for contexts in STEPS:
        _, (graph_out, eager_out) = models.verify(contexts)
        rows = _real_rows(contexts, 1 + K)
        torch.testing.assert_close(graph_out[:rows], eager_out[:rows], atol=ATOL, rtol=0)
        for index in range(1, K + 1):
            per_layer = models.draft_step(contexts, index)
            plan = per_layer[DRAFT].plan
            grown = [c + 1 + K + index for c in contexts if c is not None]
            assert plan.seq_lens_host[: len(grown)] == grown  # one longer each pass
            graph_out, eager_out = models._run(models.draft_graphs, per_layer, models.draft_key)
            rows = _real_rows(contexts, 1)
            torch.testing.assert_close(graph_out[:rows], eager_out[:rows], atol=ATOL, rtol=0)
    # One graph per model; each registry holds only its own model's attention task.
    assert models.target_graphs.tasks.keys() == [models.verify_key]
    assert models.draft_graphs.tasks.keys() == [models.draft_key]
    assert models.target_graphs.tasks.num_tasks(models.verify_key) == 1
    assert models.draft_graphs.tasks.num_tasks(models.draft_key) == 1


def test_skipped_draft_registry_update_is_caught():
    """Update the target's registry but not the drafter's: the draft replay reads the
    previous draft pass's plan (KV lengths one shorter) and differs from eager."""
    models = _SpecModels(seed=52)
    contexts = STEPS[0]
    models.verify(contexts)
    first = models.draft_step(contexts, 1)
    models._run(models.draft_graphs, first, models.draft_key)  # capture at pass 1
    second = models.draft_step(contexts, 2)
    # The target's registry cannot serve the draft's step: its layer is not there.
    try:
        models.target_graphs.tasks.update(models.verify_key, second)
    except ValueError as error:
        assert TARGET in str(error)
    else:
        raise AssertionError("the target's registry took the draft's step metadata")
    # Skip the draft update: replay directly, as a runner that forgot the drafter would.
    stale = models.draft_graphs.graphs.replay(models.draft_key, models.scale).clone()
    with set_forward_context(second, models.config):
        eager = models.draft_graphs(models.scale)
    rows = _real_rows(contexts, 1)
    assert (stale[:rows] - eager[:rows]).abs().max() > 1e-3
    # The update makes the same replay right.
    models.draft_graphs.tasks.update(models.draft_key, second)
    fresh = models.draft_graphs.graphs.replay(models.draft_key, models.scale)
    torch.testing.assert_close(fresh[:rows], eager[:rows], atol=ATOL, rtol=0)
