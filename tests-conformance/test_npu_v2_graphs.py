"""The bridge's graphs under vLLM's Model Runner V2 on the NPU, against torch_npu's API.

vLLM's V2 graph manager (the bridge's ``BridgeModelGraphManager``, as the NPU's V2 runner
builds it) captures a two-layer model whose attention is the bridge's attention task
over the ascend provider, then replays it step by step (``v2_manager_steps``). Every
torch_npu call goes through the stand-ins (signatures from the wheel, the task-update
protocol enforced, a replay held at each task group until its ExternalEvent is
recorded). Checked: NPUGraph capture on a capture stream into the platform's pool, one
task group per attention layer behind an ExternalEvent wait, the replay launched before
the task update, the update on the update stream, each event recorded after its
update, no synchronize in a step; outputs equal the reference provider's. A skipped
update and an update stream that waits for the replay it releases are caught.
"""

from __future__ import annotations

import pytest
from ascend_cases import max_error
from graph_steps import TOLERANCE
from torch_npu_schemas import SchemaViolation
from v2_manager_steps import LAYERS, v2_manager_on_the_stand_in

from npu_graphs.backends.npu import NpuGraphBackend
from npu_vllm_bridge.graphs.v2_graphs import BridgeModelGraphManager

SYNCHRONIZES = (
    "torch.npu.synchronize",
    "torch.npu.Stream.synchronize",
    "torch.npu.Event.synchronize",
)


@pytest.fixture
def v2(stand_in, monkeypatch):
    with v2_manager_on_the_stand_in(monkeypatch, stand_in.npu) as run:
        yield run


def _calls_from(stand_in, start: int) -> list:
    return stand_in.log.calls[start:]


def _check_outputs(run, step: int) -> None:
    for name, steps in zip(LAYERS, run.steps, strict=True):
        assert max_error(steps.out, steps.expected(step)) < TOLERANCE, name


def test_the_v2_manager_captures_npu_graphs_with_a_task_group_per_layer(stand_in, v2) -> None:
    assert isinstance(v2.manager, BridgeModelGraphManager)
    start = len(stand_in.log.calls)
    v2.capture()
    calls = _calls_from(stand_in, start)
    names = [call.name for call in calls]
    assert v2.desc in v2.manager.graphs and v2.manager.full.graphs.backend.name == "npu"
    (capture,) = [call for call in calls if call.name == "torch.npu.graph.__call__"]
    assert capture.arguments["pool"] is v2.manager.pool  # the platform's graph pool
    stream = capture.arguments["stream"]
    assert stream is v2.manager.full.graphs.stream
    assert stream is not stand_in.npu.runtime.default_stream
    begin, end = names.index("torch.npu.graph.__call__"), len(names)
    captured = calls[begin:end]
    groups = [call for call in captured if call.name == "torch.npu.graph_task_group_begin"]
    ends = [call for call in captured if call.name == "torch.npu.graph_task_group_end"]
    assert len(groups) == len(ends) == len(LAYERS)
    assert all(call.arguments["stream"] is stream for call in groups + ends)
    for group in groups:  # each group behind its ExternalEvent's wait and reset
        at = captured.index(group)
        assert [c.name for c in captured[at - 2 : at]] == [
            "torch.npu.ExternalEvent.wait",
            "torch.npu.ExternalEvent.reset",
        ]
    assert v2.manager.full.tasks.num_tasks(v2.desc) == len(LAYERS)
    assert not stand_in.npu.runtime.held_replays()
    _check_outputs(v2, 1)  # the replay right after the capture, its tasks released


def test_each_step_launches_the_replay_before_the_task_update(stand_in, v2) -> None:
    v2.capture()
    capture_stream = v2.manager.full.graphs.stream
    for step in (2, 3):
        start = len(stand_in.log.calls)
        v2.step(step)
        calls = _calls_from(stand_in, start)
        names = [call.name for call in calls]
        _check_outputs(v2, step)
        assert v2.manager.step_attn_metadata is None  # consumed by the replay
        assert not stand_in.npu.runtime.held_replays()
        assert not set(SYNCHRONIZES) & set(names)
        (replay,) = [i for i, name in enumerate(names) if name == "torch.npu.NPUGraph.replay"]
        begins = [i for i, name in enumerate(names) if name == "torch.npu.graph_task_update_begin"]
        assert len(begins) == len(LAYERS) and replay < begins[0]
        update_stream = calls[begins[0]].arguments["stream"]
        assert update_stream is not capture_stream
        assert update_stream is not stand_in.npu.runtime.current_stream  # not the replay's
        # the update stream waits for an event (the replay before this one), no synchronize
        waits = [i for i, name in enumerate(names) if name == "torch.npu.Stream.wait_event"]
        assert waits and replay < waits[0] < begins[0]
        for begin in begins:  # update, then its event's record, on the update stream
            assert [c.name for c in calls[begin + 1 :] if c.name.startswith("torch.npu.")][:2] == [
                "torch.npu.graph_task_update_end",
                "torch.npu.ExternalEvent.record",
            ]
            record = next(c for c in calls[begin:] if c.name == "torch.npu.ExternalEvent.record")
            assert record.arguments["stream"] is update_stream
            assert calls[begin].arguments["stream"] is update_stream


def test_a_skipped_task_update_is_caught(stand_in, v2, monkeypatch) -> None:
    v2.capture()
    monkeypatch.setattr(v2.manager.full.tasks, "update", lambda key, step: None)
    v2.step(2)
    assert not stand_in.npu.runtime.held_replays()  # released, not hung
    for steps in v2.steps:
        assert max_error(steps.out, steps.expected(2)) > 10 * TOLERANCE  # step 1's lengths


def test_an_update_stream_waiting_for_the_launched_replay_is_caught(stand_in, v2, monkeypatch):
    v2.capture()

    def waits_for_the_launched_replay(self, graph, updates) -> None:
        self._issue_updates(self._update_stream_after(self._replays), updates)

    monkeypatch.setattr(NpuGraphBackend, "update_tasks_after_replay", waits_for_the_launched_replay)
    with pytest.raises(SchemaViolation, match="deadlock"):
        v2.step(2)
