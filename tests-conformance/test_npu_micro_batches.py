"""The bridge's micro-batch wrapper (DBO) on the NPU, against torch_npu's API.

``BridgeUBatchWrapper`` with the ``npu`` graph backend runs a step vLLM split into two
micro-batches: each micro-batch, on its own thread, runs two attention layers (the
bridge's attention task over the ascend provider, one :class:`~graph_steps.Steps` per
micro-batch and layer) with a stand-in MoE collective between them, where it hands the
turn over. Every torch_npu call goes through the stand-ins (signatures from the wheel,
the task-update protocol enforced, several streams in one capture modeled: a stream
joins the capture by waiting for captured work, and must be joined back before it
ends, as torch_npu's ``capture_end`` demands; the current stream per host thread).

Checked: both micro-batches captured into one NPUGraph, each micro-batch's task groups
on its own compute stream (not the capture stream) behind their ExternalEvents; the
replay launched before the update of every micro-batch's tasks, each with its own
plan, on the update stream; no synchronize; outputs of three steps equal the reference
provider's. A micro-batch left at its captured plan, and micro-batch streams not
joined back to the capture stream, are caught.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from ascend_cases import max_error
from graph_steps import TOLERANCE, Steps
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context
from vllm.v1.worker.ubatch_utils import UBatchSlice

import npu_graphs.wrapper as npu_graphs_wrapper
from npu_graphs import GraphCaptureError, register_backend
from npu_graphs.backends.npu import NpuGraphBackend
from npu_vllm_bridge.attention.tasks import run_attention
from npu_vllm_bridge.graphs.ubatch_wrapper import (
    BridgeUBatchWrapper,
    current_micro_batch,
    micro_batch_collective,
)
from npu_vllm_bridge.settings import BridgeSettings

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NPU_SETTINGS = BridgeSettings(
    attention_provider="ascend", kv_cache_split="planes", graph_backend="npu"
)
NUM_REQS = 3  # graph_steps' batch: three decode requests per micro-batch
SLICES = [UBatchSlice(slice(0, 3), slice(0, 3)), UBatchSlice(slice(3, 6), slice(3, 6))]
KEY = BatchDescriptor(num_tokens=2 * NUM_REQS, num_reqs=2 * NUM_REQS, uniform=True)
SYNCHRONIZES = (
    "torch.npu.synchronize",
    "torch.npu.Stream.synchronize",
    "torch.npu.Event.synchronize",
)


class MicroBatchedLayers(torch.nn.Module):
    """Per micro-batch: attention, a collective (the turn passes), attention."""

    def __init__(self, steps: list[list[Steps]]) -> None:
        super().__init__()
        self.steps = steps  # [micro-batch][layer]

    def forward(self, input_ids: Any, positions: Any, **_: Any) -> torch.Tensor:
        attn_metadata = get_forward_context().attn_metadata
        layers = self.steps[current_micro_batch().index]
        for name, steps in zip(LAYERS, layers, strict=True):
            run_attention(steps.query, None, None, steps.key_cache, steps.value_cache,
                          steps.out, attn_metadata[name], layer_name=name)  # fmt: skip
            with micro_batch_collective():
                pass  # a MoE dispatch or combine would go here
        return layers[-1].out


class Run:
    def __init__(self) -> None:
        self.steps = [[Steps(), Steps()], [Steps(), Steps()]]
        self.config = VllmConfig()
        self.config.parallel_config.enable_dbo = True  # as the worker restores it
        self.wrapper = BridgeUBatchWrapper(
            MicroBatchedLayers(self.steps), self.config, full_graphs=True,
            num_attention_layers=len(LAYERS),
        )  # fmt: skip
        self.input_ids = torch.zeros(2 * NUM_REQS, dtype=torch.int64)
        self.positions = torch.zeros(2 * NUM_REQS, dtype=torch.int64)

    def metadata(self, step: int) -> list[dict[str, Any]]:
        return [
            {name: SimpleNamespace(plan=s.plan(step)) for name, s in zip(LAYERS, layers)}
            for layers in self.steps
        ]

    def step(self, step: int) -> None:
        if step > 1:  # new K/V and queries, as a decode step brings
            for index, steps in enumerate(s for layers in self.steps for s in layers):
                steps.query.copy_(steps.write_step(step, generator_seed=10 * step + index))
        with set_forward_context(
            self.metadata(step), self.config, cudagraph_runtime_mode=CUDAGraphMode.FULL,
            batch_descriptor=KEY, ubatch_slices=SLICES,
        ):  # fmt: skip
            self.wrapper(input_ids=self.input_ids, positions=self.positions)

    def errors(self, step: int) -> list[float]:
        return [max_error(s.out, s.expected(step)) for layers in self.steps for s in layers]


@pytest.fixture
def run(stand_in, monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "bridge_settings", NPU_SETTINGS, raising=False)
    monkeypatch.setattr(npu_graphs_wrapper, "_POOLS", {})
    monkeypatch.setattr(npu_graphs_wrapper, "_CAPTURE_STREAMS", {})
    register_backend("npu", NpuGraphBackend)  # a backend of this test's stand-in
    try:
        yield Run()
    finally:
        register_backend("npu", NpuGraphBackend)


def test_both_micro_batches_are_one_graph_with_task_groups_on_their_streams(stand_in, run):
    start = len(stand_in.log.calls)
    run.step(1)  # warm-up, capture, the replay after it
    calls = stand_in.log.calls[start:]
    names = [call.name for call in calls]
    assert max(run.errors(1)) < TOLERANCE
    (capture,) = [call for call in calls if call.name == "torch.npu.graph.__call__"]
    capture_stream = capture.arguments["stream"]
    captured = calls[names.index("torch.npu.graph.__call__") :]
    groups = [c for c in captured if c.name == "torch.npu.graph_task_group_begin"]
    assert len(groups) == 2 * len(LAYERS)  # one per micro-batch and layer
    streams = {id(c.arguments["stream"]) for c in groups}
    assert len(streams) == 2 and id(capture_stream) not in streams
    for group in groups:  # behind its ExternalEvent's wait and reset, on its stream
        at = captured.index(group)
        wait, reset = captured[at - 2 : at]
        assert (wait.name, reset.name) == ("torch.npu.ExternalEvent.wait",
                                           "torch.npu.ExternalEvent.reset")  # fmt: skip
        assert wait.arguments["stream"] is group.arguments["stream"]
    assert "torch.npu.Stream.wait_stream" in names  # forked from and joined to the capture
    assert names.count("torch.npu.NPUGraph.replay") == 1
    assert run.wrapper.runner.has_graph(KEY, (NUM_REQS, NUM_REQS))
    assert not set(SYNCHRONIZES) & set(names)


def test_each_replay_updates_every_micro_batch_after_its_launch(stand_in, run):
    run.step(1)
    capture_stream = run.wrapper.runner._graph.stream
    for step in (2, 3):
        start = len(stand_in.log.calls)
        run.step(step)
        calls = stand_in.log.calls[start:]
        names = [call.name for call in calls]
        assert max(run.errors(step)) < TOLERANCE, (step, run.errors(step))
        assert not stand_in.npu.runtime.held_replays()
        assert not set(SYNCHRONIZES) & set(names)
        (replay,) = [i for i, n in enumerate(names) if n == "torch.npu.NPUGraph.replay"]
        begins = [i for i, n in enumerate(names) if n == "torch.npu.graph_task_update_begin"]
        assert len(begins) == 2 * len(LAYERS) and replay < begins[0]
        update_stream = calls[begins[0]].arguments["stream"]
        assert update_stream is not capture_stream
        assert all(calls[b].arguments["stream"] is update_stream for b in begins)
        # no Python of the model ran: one graph replayed both micro-batches
        assert "torch.npu.Stream.__call__" not in names


def test_a_micro_batch_left_at_its_captured_plan_is_caught(stand_in, run, monkeypatch):
    run.step(1)
    captured = run.metadata(1)[1]
    replay = run.wrapper.runner.replay_step
    monkeypatch.setattr(
        run.wrapper.runner, "replay_step",
        lambda key, splits, inputs, steps: replay(key, splits, inputs, [steps[0], captured]),
    )  # fmt: skip
    run.step(2)
    assert not stand_in.npu.runtime.held_replays()  # updated or released, not hung
    first, second = run.errors(2)[:2], run.errors(2)[2:]
    assert max(first) < TOLERANCE
    assert min(second) > 10 * TOLERANCE  # step 1's lengths


def test_micro_batch_streams_not_joined_back_are_caught(stand_in, run, monkeypatch):
    """A runner whose capture stream never waits for the micro-batches' streams."""
    backend = run.wrapper.runner.backend
    capture_stream = run.wrapper.runner._graph.stream
    wait_stream = backend.wait_stream
    monkeypatch.setattr(
        backend, "wait_stream",
        lambda stream, other: None if stream is capture_stream else wait_stream(stream, other),
    )  # fmt: skip
    with pytest.raises(GraphCaptureError, match="not joined back to the capture stream"):
        run.step(1)


def test_the_stand_in_captures_only_streams_joined_to_the_capture(stand_in):
    """Multi-stream capture as modeled: a stream that never waited for captured work
    cannot issue into the capture; one that did is captured (and replayed)."""
    from torch_npu_schemas import SchemaViolation

    npu, steps = stand_in.npu, Steps()
    side, joined = npu.Stream(), npu.Stream()
    graph, step_plan = npu.NPUGraph(), steps.plan(1)
    with (
        pytest.raises(SchemaViolation, match="has not joined the capture"),
        npu.graph(graph, stream=npu.Stream()),
        npu.stream(side),
    ):
        steps.attend(step_plan)
    graph, capture_stream = npu.NPUGraph(), npu.Stream()
    with npu.graph(graph, stream=capture_stream):
        joined.wait_stream(capture_stream)
        with npu.stream(joined):
            steps.attend(step_plan)
        capture_stream.wait_stream(joined)
    steps.out.zero_()
    graph.replay()
    assert max_error(steps.out, steps.expected(1)) < TOLERANCE


def test_the_stand_in_keeps_a_current_stream_per_thread(stand_in):
    import threading

    npu = stand_in.npu
    mine, seen = npu.Stream(), []
    with npu.stream(mine):
        thread = threading.Thread(target=lambda: seen.append(npu.current_stream()))
        thread.start()
        thread.join()
        assert npu.current_stream() is mine
    assert seen == [npu.runtime.default_stream]
