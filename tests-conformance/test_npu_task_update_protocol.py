"""The documented NPU task-update protocol, on the stand-in runtime, with ascend attention.

The flow of torch_npu's own example (``graph_task_update_begin`` documentation):
capture the attention op inside a task group after ``ExternalEvent.wait + reset``;
per step re-issue it with new host arguments between ``graph_task_update_begin``
and ``graph_task_update_end`` on an update stream, ``record`` the event there,
replay. Here the op is the ascend provider's paged attention, so a stale length
shows up as a wrong output; each broken rule of the protocol must be caught.
"""

from __future__ import annotations

import pytest
import torch
from ascend_cases import max_error
from graph_steps import TOLERANCE, Steps
from torch_npu_schemas import SchemaViolation


def _capture(npu, steps: Steps, *, with_event: bool = True):
    graph, capture_stream, event = npu.NPUGraph(), npu.Stream(), npu.ExternalEvent()
    with npu.graph(graph, stream=capture_stream):
        stream = npu.current_stream()
        if with_event:
            event.wait(stream)
            event.reset(stream)
        npu.graph_task_group_begin(stream)
        steps.attend(steps.plan(1))
        handle = npu.graph_task_group_end(stream)
    return graph, handle, event


def _update(npu, steps: Steps, handle, event, step: int, update_stream) -> None:
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        steps.attend(steps.plan(step))
        npu.graph_task_update_end(update_stream)
        if event is not None:
            event.record(update_stream)


def test_documented_flow_replays_with_updated_lengths(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, handle, event = _capture(npu, steps)
    assert torch.equal(steps.out, torch.zeros_like(steps.out)), "capture ran the op"

    graph.replay()
    assert max_error(steps.out, steps.expected(1)) < TOLERANCE

    steps.query.copy_(steps.write_step(2, generator_seed=1))
    graph.replay()  # no update: the captured lengths are stale now
    assert max_error(steps.out, steps.expected(2)) > 10 * TOLERANCE

    _update(npu, steps, handle, event, step=2, update_stream=npu.Stream())
    graph.replay()
    assert max_error(steps.out, steps.expected(2)) < TOLERANCE
    assert "torch.npu.synchronize" not in stand_in.log.names()


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
    update_stream = npu.Stream()
    with npu.stream(update_stream), pytest.raises(SchemaViolation, match="re-issue the ops"):
        npu.graph_task_update_begin(update_stream, handle)
        step = steps.plan(2)
        step.provider.write_kv(
            steps.query[:, :2], steps.query[:, :2], steps.key_cache, steps.value_cache, step
        )
        npu.graph_task_update_end(update_stream)


def test_update_issued_off_the_update_stream_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    _graph, handle, _event = _capture(npu, steps)
    update_stream = npu.Stream()
    npu.graph_task_update_begin(update_stream, handle)
    with pytest.raises(SchemaViolation, match="not the update stream"):
        steps.attend(steps.plan(2))


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
