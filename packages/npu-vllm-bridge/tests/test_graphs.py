"""Graph wiring on host graphs: capture, task update with each step's plan, replay.

The attention of a decode step is captured once (as the bridge's updatable task,
recorded whole with its plan baked in, as an NPU task bakes its host lists), then replayed for other steps of the same
batch size with other sequence lengths, block tables and slots. Every replay must
match float64 dense attention over the raw K/V (tolerance 2e-5), so a stale host
argument (the staleness an NPU graph would have without task update) shows.
"""

from __future__ import annotations

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
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.sequence import IntermediateTensors
from vllm_builds import needs_vllm_cpu_platform

import npu_attention
from npu_graphs import GraphWrapper, RuntimeMode, TaskRegistry, graph_dispatch
from npu_vllm_bridge.attention.builder import BridgeAttentionMetadata
from npu_vllm_bridge.attention.kv_cache import split_kv_cache
from npu_vllm_bridge.attention.tasks import run_attention
from npu_vllm_bridge.graphs.counters import GraphCounters
from npu_vllm_bridge.graphs.full_graphs import per_layer_metadata
from npu_vllm_bridge.graphs.wrapper import BridgeGraphWrapper

BLOCK_SIZE, NUM_BLOCKS, BATCH = 16, 96, 4
SPEC = npu_attention.AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32)
SCALE = HEAD_SIZE**-0.5
ATOL = 2e-5
# Each step: (context lengths of the 4 decodes); the last has a padding request.
STEPS = [(40, 3, 77, 15), (41, 4, 78, 16), (7, 90, 1, 33), (12, 5, 64, None)]


def _plan(batch, spec=SPEC) -> npu_attention.AttentionPlan:
    cm = batch.common
    return npu_attention.plan(
        cm.query_start_loc_cpu,
        cm.seq_lens_cpu_upper_bound,
        cm.block_table_tensor,
        cm.slot_mapping,
        cm.num_reqs,
        spec,
        provider="reference",
    )


def _step_batch(contexts, kv_cache, generator):
    """A decode batch; ``None`` is a padding request (null block, slot -1, seq_len 1)."""
    real = [(c, 1) for c in contexts if c is not None]
    batch = make_batch(real, kv_cache, BLOCK_SIZE, generator, pad_tokens=BATCH - len(real))
    if len(real) < BATCH:
        cm = batch.common
        pad = BATCH - len(real)
        tables = torch.cat(
            [
                cm.block_table_tensor,
                torch.zeros(pad, cm.block_table_tensor.shape[1], dtype=torch.int32),
            ]
        )
        batch.common = cm.replace(
            query_start_loc_cpu=torch.arange(BATCH + 1, dtype=torch.int32),
            seq_lens_cpu_upper_bound=torch.cat(
                [cm.seq_lens_cpu_upper_bound, torch.ones(pad, dtype=torch.int32)]
            ),
            num_reqs=BATCH,
            block_table_tensor=tables,
        )
    return batch


def _pad_width(batch, width: int):
    """Block tables at a fixed width, as vLLM's persistent block table has."""
    cm = batch.common
    tables = torch.zeros(cm.num_reqs, width, dtype=torch.int32)
    tables[:, : cm.block_table_tensor.shape[1]] = cm.block_table_tensor
    batch.common = cm.replace(block_table_tensor=tables)
    return batch


class _Inputs:
    """Static input buffers of the captured step (the caller owns addresses)."""

    def __init__(self):
        self.query = torch.zeros(BATCH, NUM_HEADS, HEAD_SIZE)
        self.key = torch.zeros(BATCH, NUM_KV_HEADS, HEAD_SIZE)
        self.value = torch.zeros(BATCH, NUM_KV_HEADS, HEAD_SIZE)

    def load(self, batch):
        self.query.copy_(batch.query)
        self.key.copy_(batch.key)
        self.value.copy_(batch.value)


def _attention_step(inputs, key_cache, value_cache, current):
    """The graphed callable: one layer's attention on the step in ``current["plan"]``."""

    def step(_):
        out = torch.empty(BATCH, NUM_HEADS, HEAD_SIZE)
        run_attention(
            inputs.query * 1.0,
            inputs.key,
            inputs.value,
            key_cache,
            value_cache,
            out,
            _metadata(current["plan"]),
            layer_name="layer",
        )
        return out * 1.0

    return step


def test_task_update_makes_each_replay_match_naive_attention():
    generator = torch.Generator().manual_seed(11)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    key_cache, value_cache = split_kv_cache(kv_cache, HEAD_SIZE)
    inputs = _Inputs()
    current = {}

    step = _attention_step(inputs, key_cache, value_cache, current)
    registry = TaskRegistry("attention", expected_tasks=1)
    graph = GraphWrapper(step, backend="host", tasks=registry)
    for index, contexts in enumerate(STEPS):
        batch = _pad_width(_step_batch(contexts, kv_cache, generator), width=8)
        inputs.load(batch)
        current["plan"] = _plan(batch)
        if index:
            registry.update("decode-4", {"layer": _metadata(current["plan"])})
        with graph_dispatch(RuntimeMode.FULL, "decode-4"):
            out = graph(None)
        real = sum(c is not None for c in contexts)
        expected = naive_attention(batch, SCALE)[:real]
        torch.testing.assert_close(out[:real].double(), expected, atol=ATOL, rtol=0)
    assert graph.entry("decode-4").replays == len(STEPS) - 1


def test_replay_without_update_keeps_capture_arguments():
    """The control: without the update, the replay reads the captured step (stale)."""
    generator = torch.Generator().manual_seed(12)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    key_cache, value_cache = split_kv_cache(kv_cache, HEAD_SIZE)
    inputs = _Inputs()
    current = {}

    step = _attention_step(inputs, key_cache, value_cache, current)
    graph = GraphWrapper(step, backend="host", tasks=TaskRegistry("attention"))
    for contexts in STEPS[:2]:
        batch = _pad_width(_step_batch(contexts, kv_cache, generator), width=8)
        inputs.load(batch)
        current["plan"] = _plan(batch)
        with graph_dispatch(RuntimeMode.FULL, "decode-4"):
            out = graph(None)
    stale = (out.double() - naive_attention(batch, SCALE)).abs().max()
    assert stale > 1e-2


def _metadata(plan) -> BridgeAttentionMetadata:
    return BridgeAttentionMetadata(plan=plan, num_actual_tokens=BATCH)


WINDOWED = npu_attention.AttentionSpec(
    NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, sliding_window=10
)


class _TwoGroups(torch.nn.Module):
    """Two attention layers of different KV-cache groups: full, then sliding window."""

    def __init__(self, inputs, caches):
        super().__init__()
        self.inputs, self.caches = inputs, caches

    def forward(self, query):
        from vllm.forward_context import get_forward_context

        per_layer = get_forward_context().attn_metadata
        out = torch.empty(BATCH, NUM_HEADS, HEAD_SIZE)
        self._layer("layer.0", query, out, per_layer)
        second = torch.empty_like(out)
        self._layer("layer.1", out * 0.5, second, per_layer)
        return second

    def _layer(self, name, query, out, per_layer):
        key_cache, value_cache = self.caches[name]
        k, v = self.inputs.key, self.inputs.value
        run_attention(query, k, v, key_cache, value_cache, out, per_layer[name], layer_name=name)


def test_bridge_wrapper_updates_each_kv_cache_group_with_its_own_plan():
    """FULL graphs of a model with two KV-cache groups (one plan each): every replay
    equals eager, and vLLM's capture counter counts the capture."""
    from vllm.compilation.counter import compilation_counter

    config = VllmConfig()
    generator = torch.Generator().manual_seed(13)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    caches = dict.fromkeys(("layer.0", "layer.1"), split_kv_cache(kv_cache, HEAD_SIZE))
    inputs = _Inputs()
    captured_before = compilation_counter.num_cudagraph_captured
    wrapper = BridgeGraphWrapper(
        _TwoGroups(inputs, caches), config, CUDAGraphMode.FULL, num_attention_layers=2,
        graph_backend="host",
    )  # fmt: skip
    descriptor = BatchDescriptor(num_tokens=BATCH, num_reqs=BATCH, uniform=True)
    for contexts in STEPS:
        batch = _pad_width(_step_batch(contexts, kv_cache, generator), width=8)
        inputs.load(batch)
        per_layer = {
            "layer.0": _metadata(_plan(batch)),
            "layer.1": _metadata(_plan(batch, WINDOWED)),
        }
        with set_forward_context(
            per_layer, config, cudagraph_runtime_mode=CUDAGraphMode.FULL,
            batch_descriptor=descriptor,
        ):  # fmt: skip
            graph_out = wrapper(inputs.query).clone()
        with set_forward_context(per_layer, config):  # eager, as a step with no graph runs
            eager_out = wrapper(inputs.query)
        real = sum(c is not None for c in contexts)
        torch.testing.assert_close(graph_out[:real], eager_out[:real], atol=ATOL, rtol=0)
    counters = wrapper.counters
    assert counters is wrapper.full.counters  # the graph component's own
    assert counters.captured == 1
    assert compilation_counter.num_cudagraph_captured == captured_before + 1
    assert counters.replayed_steps == len(STEPS) - 1
    assert counters.task_updates == len(STEPS) - 1
    assert counters.eager_steps == len(STEPS)
    wrapper.clear_graphs()  # as after the memory profile: neither graphs nor counts stay
    assert not wrapper.has_graph(descriptor) and wrapper.counters.captured == 0


def test_skipped_update_of_one_group_is_caught():
    """The control for several groups: re-issue only the first group's tasks with the
    new step, and the second group's layer replays its stale plan."""
    config = VllmConfig()
    generator = torch.Generator().manual_seed(16)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    caches = dict.fromkeys(("layer.0", "layer.1"), split_kv_cache(kv_cache, HEAD_SIZE))
    inputs = _Inputs()
    wrapper = BridgeGraphWrapper(
        _TwoGroups(inputs, caches), config, CUDAGraphMode.FULL, num_attention_layers=2,
        graph_backend="host",
    )  # fmt: skip
    descriptor = BatchDescriptor(num_tokens=BATCH, num_reqs=BATCH, uniform=True)
    per_layer_of = []
    for contexts in STEPS[:2]:
        batch = _pad_width(_step_batch(contexts, kv_cache, generator), width=8)
        per_layer_of.append(
            {"layer.0": _metadata(_plan(batch)), "layer.1": _metadata(_plan(batch, WINDOWED))}
        )
    inputs.load(batch)
    with set_forward_context(
        per_layer_of[0], config, cudagraph_runtime_mode=CUDAGraphMode.FULL,
        batch_descriptor=descriptor,
    ):  # fmt: skip
        wrapper(inputs.query)  # capture with step 0
    mixed = {"layer.0": per_layer_of[1]["layer.0"], "layer.1": per_layer_of[0]["layer.1"]}
    wrapper.tasks.update(descriptor, mixed)
    graph_out = wrapper.graphs.replay(descriptor, inputs.query).clone()
    with set_forward_context(per_layer_of[1], config):
        eager_out = wrapper(inputs.query)
    assert (graph_out - eager_out).abs().max() > 1e-3


class _PipelineStage(torch.nn.Module):
    """A middle pipeline stage without attention: hidden states and residual in and out
    as vLLM's ``IntermediateTensors``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, positions, intermediate_tensors):
        hidden = self.proj(intermediate_tensors["hidden_states"]) + positions[:, None]
        return IntermediateTensors({"hidden_states": hidden, "residual": hidden * 2})


def test_pipeline_stage_tensors_pass_through_full_graphs():
    """A stage's hidden states from the previous stage go into each replay, and each
    replay returns its own (a host graph would otherwise hand back the capture's)."""
    config = VllmConfig()
    stage = _PipelineStage()
    wrapper = BridgeGraphWrapper(
        stage, config, CUDAGraphMode.FULL, num_attention_layers=0, graph_backend="host"
    )
    descriptor = BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True)
    positions, received = torch.zeros(4), torch.zeros(4, 8)  # vLLM's persistent buffers
    generator = torch.Generator().manual_seed(3)
    for step in range(3):
        positions.copy_(torch.arange(4) + step)
        received.copy_(torch.randn(4, 8, generator=generator))
        with set_forward_context(
            {}, config, cudagraph_runtime_mode=CUDAGraphMode.FULL, batch_descriptor=descriptor
        ):
            out = wrapper(positions, IntermediateTensors({"hidden_states": received}))
        assert isinstance(out, IntermediateTensors)
        expected = stage(positions, IntermediateTensors({"hidden_states": received}))
        for name in ("hidden_states", "residual"):
            torch.testing.assert_close(out[name], expected[name], atol=1e-6, rtol=0)
    assert wrapper.graphs.entry(descriptor).replays == 2


def test_wrapper_refuses_modes_it_cannot_run():
    with pytest.raises(ValueError, match=r"FULL or PIECEWISE.*NONE"):
        BridgeGraphWrapper(lambda: None, VllmConfig(), CUDAGraphMode.NONE, graph_backend="host")


def test_replayed_metadata_must_be_per_layer():
    generator = torch.Generator().manual_seed(14)
    kv_cache = packed_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    one = _metadata(_plan(_step_batch(STEPS[0], kv_cache, generator)))
    assert per_layer_metadata({"a": one})["a"] is one
    with pytest.raises(ValueError, match=r"layer_name: metadata.*got list"):
        per_layer_metadata([{"a": one}])


@needs_vllm_cpu_platform
def test_decode_steps_off_the_captured_grid_are_counted_and_logged_once(monkeypatch):
    from types import SimpleNamespace

    from vllm.config import CompilationConfig

    from npu_vllm_bridge.graphs import counters as counters_module

    largest = 4
    config = VllmConfig(
        compilation_config=CompilationConfig(
            cudagraph_capture_sizes=[1, 2, largest], max_cudagraph_capture_size=largest
        )
    )
    wrapper = BridgeGraphWrapper(
        lambda x: x * 2, config, CUDAGraphMode.FULL, num_attention_layers=0, graph_backend="host"
    )
    warnings = []
    monkeypatch.setattr(counters_module.logger, "warning", lambda *args: warnings.append(args))
    wrapper.counters.serving = True  # as the runner sets it after start-up
    x = torch.ones(3)
    steps = [(largest + 4, 0), (largest, 0), (largest + 8, 0), (largest + 16, 1)]
    for num_tokens, num_prefills in steps:
        per_layer = {"layer": SimpleNamespace(plan=SimpleNamespace(num_prefills=num_prefills))}
        key = BatchDescriptor(num_tokens=num_tokens)
        with set_forward_context(per_layer, config, batch_descriptor=key):  # NONE: eager
            torch.testing.assert_close(wrapper(x), x * 2)
    counters = wrapper.counters
    # Every step ran eagerly; the two decodes above the grid are off it (a prefill that
    # large runs eagerly by design), and only the first is logged.
    assert counters.eager_steps == 4 and counters.off_grid_steps == 2, counters
    assert len(warnings) == 1 and warnings[0][1:] == (largest + 4, largest), warnings


def test_counters_are_written_per_rank_where_asked(tmp_path, monkeypatch):
    import json

    from npu_vllm_bridge.graphs.counters import COUNTERS_DIR_ENV, write_counters_where_asked

    def not_read() -> GraphCounters:
        raise AssertionError("counters read while nothing asks for them")

    monkeypatch.delenv(COUNTERS_DIR_ENV, raising=False)
    write_counters_where_asked(not_read, 0, 0)  # not asked: nothing read or written
    monkeypatch.setenv(COUNTERS_DIR_ENV, str(tmp_path))
    counters = GraphCounters(split_steps=3)
    write_counters_where_asked(lambda: counters, 1, 0)
    counters.split_steps = 4
    write_counters_where_asked(lambda: counters, 1, 0)  # replaced whole, no partial file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp1-rank0.json"]
    written = json.loads((tmp_path / "dp1-rank0.json").read_text())
    assert written == counters.as_dict() and written["split_steps"] == 4
