"""The documented NPU task-update protocol, on the stand-in runtime, with ascend attention.

The flow of torch_npu's own example (``graph_task_update_begin`` documentation):
capture the attention op inside a task group after ``ExternalEvent.wait + reset``;
per step re-issue it with new host arguments between ``graph_task_update_begin``
and ``graph_task_update_end`` on an update stream, ``record`` the event there,
replay. The captured wait holds the replay at the group until the event is
recorded, so the replay may also be launched first and updated after. Here the op
is the ascend provider's paged attention, so a stale length shows up as a wrong
output; each broken rule of the protocol must be caught.
"""

from __future__ import annotations

import pytest
import torch
from ascend_cases import max_error
from graph_steps import TOLERANCE, Steps
from torch_npu_schemas import SchemaViolation


def _capture(npu, steps: Steps, *, with_event: bool = True):
    graph, capture_stream, event = npu.NPUGraph(), npu.Stream(), npu.ExternalEvent()
    step_plan = steps.plan(1)  # host work, before the capture (as an engine plans)
    with npu.graph(graph, stream=capture_stream):
        stream = npu.current_stream()
        if with_event:
            event.wait(stream)
            event.reset(stream)
        npu.graph_task_group_begin(stream)
        steps.attend(step_plan)
        handle = npu.graph_task_group_end(stream)
    return graph, handle, event


def _update(npu, steps: Steps, handle, event, step: int, update_stream) -> None:
    step_plan = steps.plan(step)  # host work, before the update
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        steps.attend(step_plan)
        npu.graph_task_update_end(update_stream)
        if event is not None:
            event.record(update_stream)


def test_documented_flow_replays_with_updated_lengths(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, handle, event = _capture(npu, steps)
    assert torch.equal(steps.out, torch.zeros_like(steps.out)), "capture ran the op"

    event.record(npu.Stream())  # no update: release the captured lengths
    graph.replay()
    assert max_error(steps.out, steps.expected(1)) < TOLERANCE

    steps.query.copy_(steps.write_step(2, generator_seed=1))
    event.record(npu.Stream())
    graph.replay()  # no update: the captured lengths are stale now
    assert max_error(steps.out, steps.expected(2)) > 10 * TOLERANCE

    _update(npu, steps, handle, event, step=2, update_stream=npu.Stream())
    graph.replay()
    assert max_error(steps.out, steps.expected(2)) < TOLERANCE
    assert "torch.npu.synchronize" not in stand_in.log.names()


def test_replay_is_held_at_the_group_until_its_update_releases_it(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, handle, event = _capture(npu, steps)
    steps.query.copy_(steps.write_step(2, generator_seed=1))
    graph.replay()  # launched first: waits at the task group
    assert torch.equal(steps.out, torch.zeros_like(steps.out))
    assert len(stand_in.npu.runtime.held_replays()) == 1
    _update(npu, steps, handle, event, step=2, update_stream=npu.Stream())
    assert not stand_in.npu.runtime.held_replays()
    assert max_error(steps.out, steps.expected(2)) < TOLERANCE


def test_synchronize_with_a_held_replay_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, _handle, _event = _capture(npu, steps)
    graph.replay()
    with pytest.raises(SchemaViolation, match="would never return"):
        npu.synchronize()


def test_event_recorded_before_the_update_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, handle, event = _capture(npu, steps)
    steps.query.copy_(steps.write_step(2, generator_seed=1))
    graph.replay()
    event.record(npu.Stream())  # releases the replay with the captured lengths
    _update(npu, steps, handle, None, step=2, update_stream=npu.Stream())
    assert max_error(steps.out, steps.expected(2)) > 10 * TOLERANCE


def test_update_of_a_group_its_held_replay_already_ran_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, stream = npu.NPUGraph(), npu.Stream()
    events, handles = [npu.ExternalEvent(), npu.ExternalEvent()], []
    step_plan = steps.plan(1)
    with npu.graph(graph, stream=stream):
        for event in events:  # two task groups (two layers, say)
            event.wait(stream)
            event.reset(stream)
            npu.graph_task_group_begin(stream)
            steps.attend(step_plan)
            handles.append(npu.graph_task_group_end(stream))
    graph.replay()
    events[0].record(npu.Stream())  # the first group runs, the replay waits at the second
    with pytest.raises(SchemaViolation, match="already ran"):
        _update(npu, steps, handles[0], events[0], step=2, update_stream=npu.Stream())


def test_update_stream_waiting_for_the_replay_it_releases_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, handle, event = _capture(npu, steps)
    graph.replay()
    replay_done, update_stream = npu.Event(), npu.Stream()
    replay_done.record(npu.current_stream())
    update_stream.wait_event(replay_done)
    with pytest.raises(SchemaViolation, match="deadlock"):
        _update(npu, steps, handle, event, step=2, update_stream=update_stream)


def test_update_on_the_capture_stream_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    _graph, handle, event = _capture(npu, steps)
    with pytest.raises(SchemaViolation, match="update stream must differ from the capture"):
        _update(npu, steps, handle, event, step=2, update_stream=handle.graph.capture_stream)


def test_replay_before_the_event_is_recorded_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, handle, _ = _capture(npu, steps)
    _update(npu, steps, handle, None, step=2, update_stream=npu.Stream())
    with pytest.raises(SchemaViolation, match="ExternalEvent was not recorded"):
        graph.replay()


def test_update_without_an_external_event_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, handle, event = _capture(npu, steps, with_event=False)
    _update(npu, steps, handle, event, step=2, update_stream=npu.Stream())
    with pytest.raises(SchemaViolation, match="no ExternalEvent orders the replay"):
        graph.replay()


def test_update_with_other_ops_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    _graph, handle, _event = _capture(npu, steps)
    update_stream, step = npu.Stream(), steps.plan(2)
    rows = steps.query[:, :2].contiguous()
    with npu.stream(update_stream), pytest.raises(SchemaViolation, match="re-issue the ops"):
        npu.graph_task_update_begin(update_stream, handle)
        step.provider.write_kv(rows, rows, steps.key_cache, steps.value_cache, step)
        npu.graph_task_update_end(update_stream)


def test_update_issued_off_the_update_stream_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    _graph, handle, _event = _capture(npu, steps)
    update_stream, step = npu.Stream(), steps.plan(2)
    npu.graph_task_update_begin(update_stream, handle)
    with pytest.raises(SchemaViolation, match="not the update stream"):
        steps.attend(step)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda npu: npu.graph_task_group_start(npu.current_stream()),
            "no attribute 'graph_task_group_start'",
        ),
        (
            lambda npu: npu.graph_task_update_begin(npu.Stream(), None, task=None),
            "unexpected keyword argument 'task'",
        ),
        (lambda npu: npu.graph_task_group_end(), "missing a required argument: 'stream'"),
        (
            lambda npu: npu.ExternalEvent().record(npu.Stream(), npu.Stream()),
            "too many positional arguments",
        ),
        (
            lambda npu: npu.graph_task_group_begin(npu.current_stream()),
            "graph_task_group_begin outside a capture",
        ),
        (lambda npu: npu.NPUGraph().capture_begin(), "capture on the default stream"),
    ],
)
def test_wrong_runtime_calls_are_caught(stand_in, call, message) -> None:
    with pytest.raises(SchemaViolation, match=message):
        call(stand_in.npu)


def test_synchronize_during_capture_is_caught(stand_in) -> None:
    npu = stand_in.npu
    with (
        pytest.raises(SchemaViolation, match="synchronize during a capture"),
        npu.graph(npu.NPUGraph(), stream=npu.Stream()),
    ):
        npu.synchronize()
