"""The micro-batch wrapper (DBO) on host graphs, against the unsplit batch.

A toy model of two attention layers with a stand-in MoE collective between them (where
a data-parallel MoE layer dispatches and combines) runs one decode step split into two
micro-batches by vLLM's own slicing (``maybe_create_ubatch_slices``,
``split_attn_metadata``), each with its own plan. Eager split runs, and the replays of
the one graph that holds both micro-batches (each micro-batch's attention tasks updated
with its own plan), must give the rows of the same step run whole (tolerance 2e-5);
leaving one micro-batch's tasks at their captured plan must show.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from bridge_batches import HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, make_batch, packed_kv_cache
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context
from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices, split_attn_metadata

import npu_attention
from npu_vllm_bridge.attention.builder import BridgeAttentionMetadata
from npu_vllm_bridge.attention.kv_cache import split_kv_cache
from npu_vllm_bridge.attention.tasks import run_attention
from npu_vllm_bridge.graphs import ubatch_config
from npu_vllm_bridge.graphs.counters import GraphCounters, sum_counters
from npu_vllm_bridge.graphs.ubatch_wrapper import (
    BridgeUBatchWrapper,
    current_micro_batch,
    micro_batch_collective,
    micro_batch_id,
    micro_batch_token_offset,
    vllm_ubatch_wrapper_bypassed,
)

BLOCK_SIZE, NUM_BLOCKS = 16, 128
SPEC = npu_attention.AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32)
ATOL = 2e-5
LAYERS = ("layer.0", "layer.1")
# Decode steps of five requests (context lengths): vLLM splits five tokens 2 + 3.
STEPS = [(40, 3, 77, 15, 9), (41, 4, 78, 16, 10), (7, 90, 1, 33, 60)]
WIDTH = 8  # block-table width, fixed as vLLM's persistent block table


def _plan(cm) -> BridgeAttentionMetadata:
    plan = npu_attention.plan(
        cm.query_start_loc_cpu, cm.seq_lens_cpu_upper_bound, cm.block_table_tensor,
        cm.slot_mapping, cm.num_reqs, SPEC, provider="reference",
    )  # fmt: skip
    return BridgeAttentionMetadata(plan=plan, num_actual_tokens=cm.num_actual_tokens)


class _Toy(torch.nn.Module):
    """Per token: attention, a collective (x * 0.5 + 1, standing for a MoE dispatch and
    combine), attention again. K/V of a token come from its own input."""

    def __init__(self, caches, trace):
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        width = NUM_HEADS * HEAD_SIZE
        self.to_kv = torch.randn(width, 2 * NUM_KV_HEADS * HEAD_SIZE, generator=generator) / 16
        self.caches, self.trace = caches, trace

    def forward(self, input_ids, positions, inputs_embeds=None, intermediate_tensors=None):
        x = inputs_embeds
        for index, name in enumerate(LAYERS):
            x = self._attention(name, x)
            micro_batch = current_micro_batch()
            self.trace.append((None if micro_batch is None else micro_batch.index, index))
            with micro_batch_collective():
                x = x * 0.5 + 1.0
        return x + positions[:, None]

    def _attention(self, name, x):
        per_layer = get_forward_context().attn_metadata
        kv = (x @ self.to_kv).view(-1, 2, NUM_KV_HEADS, HEAD_SIZE)
        query = x.view(-1, NUM_HEADS, HEAD_SIZE)
        out = torch.empty_like(query)
        key_cache, value_cache = self.caches[name]
        run_attention(query, kv[:, 0], kv[:, 1], key_cache, value_cache, out, per_layer[name],
                      layer_name=name)  # fmt: skip
        return out.view(x.shape)


class _Setup:
    def __init__(self, full_graphs: bool, seed: int):
        self.config = VllmConfig()
        self.config.parallel_config.enable_dbo = True  # as the worker restores it
        self.generator = torch.Generator().manual_seed(seed)
        self.kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        caches = dict.fromkeys(LAYERS, split_kv_cache(self.kv_cache, HEAD_SIZE))
        self.trace: list = []
        self.model = _Toy(caches, self.trace)
        self.wrapper = BridgeUBatchWrapper(
            self.model, self.config, full_graphs=full_graphs, num_attention_layers=len(LAYERS),
            graph_backend="host",
        )  # fmt: skip
        n = len(STEPS[0])
        self.embeds = torch.zeros(n, NUM_HEADS * HEAD_SIZE)  # static inputs (graph buffers)
        self.positions = torch.zeros(n, dtype=torch.int64)
        self.input_ids = torch.zeros(n, dtype=torch.int64)

    def counters(self) -> GraphCounters:
        """The wrapper's counters with its inner FULL graph wrapper's (the unsplit steps)."""
        inner = [] if self.wrapper.inner is None else [self.wrapper.inner.counters]
        return sum_counters([self.wrapper.counters, *inner])

    def step(self, contexts):
        """Load one decode step; returns its whole metadata, per-micro-batch metadata and slices."""
        batch = make_batch([(c, 1) for c in contexts], self.kv_cache, BLOCK_SIZE, self.generator)
        cm = batch.common
        tables = torch.zeros(cm.num_reqs, WIDTH, dtype=torch.int32)
        tables[:, : cm.block_table_tensor.shape[1]] = cm.block_table_tensor
        cm = cm.replace(block_table_tensor=tables)
        self.embeds.copy_(torch.randn(self.embeds.shape, generator=self.generator))
        self.positions.copy_(torch.tensor(contexts))
        n = len(contexts)
        slices, _ = maybe_create_ubatch_slices(True, np.ones(n, dtype=np.int32), n, n, 2)
        whole = dict.fromkeys(LAYERS, _plan(cm))
        halves = [dict.fromkeys(LAYERS, _plan(part)) for part in split_attn_metadata(slices, cm)]
        return whole, halves, slices

    def run(self, attn_metadata, slices=None, mode=CUDAGraphMode.NONE):
        descriptor = BatchDescriptor(num_tokens=len(self.embeds), uniform=True)
        with set_forward_context(attn_metadata, self.config, cudagraph_runtime_mode=mode,
                                 batch_descriptor=descriptor, ubatch_slices=slices):  # fmt: skip
            out = self.wrapper(input_ids=self.input_ids, positions=self.positions,
                               inputs_embeds=self.embeds)  # fmt: skip
        return out.clone()


def test_eager_split_equals_the_whole_step_and_hands_over_at_each_collective():
    setup = _Setup(full_graphs=False, seed=21)
    whole, halves, slices = setup.step(STEPS[0])
    assert [s.num_tokens for s in slices] == [2, 3]  # vLLM's unequal halves
    reference = setup.run(whole)
    setup.trace.clear()
    split = setup.run(halves, slices)
    torch.testing.assert_close(split, reference, atol=ATOL, rtol=0)
    # Micro-batch 0 runs to its first collective, hands over, and so on.
    assert setup.trace == [(0, 0), (1, 0), (0, 1), (1, 1)]
    counters = setup.counters()
    assert counters.split_steps == counters.split_decode_steps == 1
    assert counters.split_forwards_run == 1
    # Each micro-batch hands over after each of its collectives (2 x 2).
    assert counters.split_yields == 4
    assert counters.as_dict()["yields_per_split_forward"] == 4
    assert "1 split (1 decode, 0 with a prefill)" in counters.describe_micro_batching()


def test_one_graph_of_both_micro_batches_replays_each_with_its_own_plan():
    setup = _Setup(full_graphs=True, seed=22)
    for index, contexts in enumerate(STEPS):
        whole, halves, slices = setup.step(contexts)
        reference = setup.run(whole)  # eagerly, unsplit
        setup.trace.clear()
        graph_out = setup.run(halves, slices, CUDAGraphMode.FULL)
        torch.testing.assert_close(graph_out, reference, atol=ATOL, rtol=0)
        if index:  # replays run no Python of the model
            assert setup.trace == []
    counters = setup.counters()
    assert counters.split_captured == counters.captured == 1
    assert counters.split_replayed_steps == counters.split_task_updates == len(STEPS) - 1
    key = setup.wrapper.runner.graph_key(BatchDescriptor(num_tokens=5, uniform=True), (2, 3))
    tasks = setup.wrapper.tasks.tasks(key)
    assert sorted((t.micro_batch, t.name) for t in tasks) == [
        (0, "layer.0"), (0, "layer.1"), (1, "layer.0"), (1, "layer.1"),
    ]  # fmt: skip


def test_a_skipped_micro_batch_task_update_is_caught(monkeypatch):
    """The control: a wrapper that leaves micro-batch 1's tasks at the plan they were
    captured with replays stale rows there (micro-batch 0's rows stay right)."""
    setup = _Setup(full_graphs=True, seed=23)
    whole, halves, slices = setup.step(STEPS[0])
    setup.run(halves, slices, CUDAGraphMode.FULL)  # capture with step 0's plans
    captured = halves[1]
    replay = setup.wrapper.runner.replay_step
    monkeypatch.setattr(
        setup.wrapper.runner, "replay_step",
        lambda key, splits, inputs, steps: replay(key, splits, inputs, [steps[0], captured]),
    )  # fmt: skip
    whole, halves, slices = setup.step(STEPS[2])
    reference = setup.run(whole)
    graph_out = setup.run(halves, slices, CUDAGraphMode.FULL)
    torch.testing.assert_close(graph_out[:2], reference[:2], atol=ATOL, rtol=0)
    assert (graph_out[2:] - reference[2:]).abs().max() > 1e-2


def test_unsplit_steps_take_the_full_graph_wrapper():
    setup = _Setup(full_graphs=True, seed=24)
    for contexts in STEPS[:2]:
        whole, _, _ = setup.step(contexts)
        eager = setup.run(whole)
        torch.testing.assert_close(setup.run(whole, mode=CUDAGraphMode.FULL), eager,
                                   atol=ATOL, rtol=0)  # fmt: skip
    counters = setup.counters()
    assert counters.split_steps == 0 and counters.replayed_steps == 1
    assert setup.wrapper.has_graph(BatchDescriptor(num_tokens=5, uniform=True))


def test_the_platform_holds_micro_batching_and_the_worker_restores_it():
    config = VllmConfig()
    parallel = config.parallel_config
    parallel.enable_dbo, parallel.dbo_decode_token_threshold = True, 4
    assert ubatch_config.hold_micro_batching(config)
    # What vLLM's checks after the platform's see: no DBO (no all-to-all assert).
    assert not parallel.use_ubatching
    assert config.additional_config[ubatch_config.HELD_KEY] == {
        "enable_dbo": True, "ubatch_size": 0,
    }  # fmt: skip
    assert ubatch_config.restore_micro_batching(config)
    assert parallel.use_ubatching and parallel.num_ubatches == 2
    assert parallel.dbo_decode_token_threshold == 4
    assert not ubatch_config.restore_micro_batching(VllmConfig())


def test_vllm_modules_read_the_micro_batch_threads_ids():
    """What vLLM keeps per micro-batch (shared-expert outputs) it indexes by
    ``dbo_current_ubatch_id``: inside the bridge's micro-batches, their index."""
    from vllm.model_executor.layers.fused_moe.runner import shared_experts

    setup = _Setup(full_graphs=False, seed=25)
    assert shared_experts.dbo_current_ubatch_id is micro_batch_id
    seen = []
    model = setup.model
    forward = model.forward

    def recording(*args, **kwargs):
        seen.append(shared_experts.dbo_current_ubatch_id())
        return forward(*args, **kwargs)

    model.forward = recording
    _, halves, slices = setup.step(STEPS[0])
    setup.run(halves, slices)
    assert sorted(seen) == [0, 1] and micro_batch_id() == 0


def test_vllm_modules_read_each_micro_batchs_first_row():
    """What vLLM 0.33 records per token of a micro-batch (routed experts) it places by
    ``dbo_current_ubatch_token_offset``: inside the bridge's micro-batches, the first row
    of each in the step's batch (vLLM's slices: 2 + 3 tokens)."""
    from vllm.v1.worker import ubatching

    if not hasattr(ubatching, "dbo_current_ubatch_token_offset"):
        pytest.skip("this vLLM (before 0.33) has no dbo_current_ubatch_token_offset")
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer

    setup = _Setup(full_graphs=False, seed=26)
    assert routed_experts_capturer.dbo_current_ubatch_token_offset is micro_batch_token_offset
    seen = []
    model = setup.model
    forward = model.forward

    def recording(*args, **kwargs):
        rows = kwargs["inputs_embeds"].shape[0]
        seen.append((routed_experts_capturer.dbo_current_ubatch_token_offset(), rows))
        return forward(*args, **kwargs)

    model.forward = recording
    _, halves, slices = setup.step(STEPS[0])
    setup.run(halves, slices)
    assert sorted(seen) == [(0, 2), (2, 3)], seen
    assert micro_batch_token_offset() == 0  # outside: vLLM's own answer


def test_vllm_gpu_runner_leaves_the_model_unwrapped_for_the_bridge():
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner

    model = torch.nn.Linear(2, 2)
    with vllm_ubatch_wrapper_bypassed():
        wrapped = gpu_model_runner.UBatchWrapper(model, VllmConfig(), CUDAGraphMode.FULL, None)
        assert wrapped is model and not isinstance(model, gpu_model_runner.UBatchWrapper)
    assert gpu_model_runner.UBatchWrapper.__name__ == "UBatchWrapper"


def test_micro_batching_refuses_what_it_does_not_run(monkeypatch):
    """V1 refuses the bridge's list; V2 (which vLLM runs DBO on only when asked by
    ``VLLM_USE_V2_MODEL_RUNNER=1``) refuses what vLLM's V2 runner refuses; the message
    names the runner, what micro-batching runs without and what came with it."""
    config = VllmConfig()
    config.parallel_config.enable_dbo = True
    config.parallel_config.pipeline_parallel_size = 2
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert not config.use_v2_model_runner  # vLLM's choice for DBO without the variable
    with pytest.raises(ValueError, match=r"on Model Runner V1 without pipeline_parallel_size=2"):
        ubatch_config.hold_micro_batching(config)
    config.parallel_config.pipeline_parallel_size = 1
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert config.use_v2_model_runner
    assert ubatch_config.hold_micro_batching(config)  # a plain decoder micro-batches on V2
    assert ubatch_config.restore_micro_batching(config)
    config.speculative_config = SimpleNamespace(method="eagle")  # read for being there
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    expected = (
        r"on Model Runner V2 without dual batch overlap with speculative decoding, "
        r"dual batch overlap with PIECEWISE CUDA graphs; got them together"
    )
    with pytest.raises(ValueError, match=expected):
        ubatch_config.hold_micro_batching(config)
    assert config.parallel_config.enable_dbo  # refused before anything was held
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    with pytest.raises(ValueError, match=r"on Model Runner V1 without speculative decoding"):
        ubatch_config.hold_micro_batching(config)
