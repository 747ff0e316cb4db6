"""The ``npu`` graph backend of npu-graphs against torch_npu's Python API.

The backend runs on the stand-in ``torch.npu`` (every call bound to torch_npu's
own signatures, the task-update protocol enforced: update stream other than the
capture stream, ExternalEvent wait + reset in capture and record after the
update, same ops re-issued). The captured task is the ascend provider's paged
attention, driven through ``GraphWrapper`` and ``TaskRegistry`` exactly as an
engine would; outputs are compared with the reference provider run eagerly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ascend_cases import max_error
from call_sites import calls_through
from graph_steps import TOLERANCE, Steps
from torch_npu_schemas import SchemaViolation

import npu_graphs.backends.npu as npu_backend_module
from npu_graphs import GraphCaptureError, GraphWrapper, RuntimeMode, TaskRegistry, graph_dispatch
from npu_graphs.backends.npu import NpuGraphBackend

KEY = 3  # the batch key: three decode tokens


def _attend(query, key_cache, value_cache, out, *, plan) -> None:
    plan.provider.attend(query, key_cache, value_cache, plan, out)


class DecodeModel:
    """One attention layer whose step state (the plan) reaches the graph as a task."""

    def __init__(self, steps: Steps, backend: NpuGraphBackend) -> None:
        self.steps = steps
        self.plan = steps.plan(1)
        self.tasks = TaskRegistry("attention", expected_tasks=1)
        # Own stream and pool: the process-wide ones would outlive this test's stand-in.
        self.wrapper = GraphWrapper(
            self.forward,
            backend=backend,
            tasks=self.tasks,
            stream=backend.new_stream(),
            pool=backend.new_pool(),
        )

    def forward(self, query):
        steps = self.steps
        self.tasks.call(
            _attend,
            query,
            steps.key_cache,
            steps.value_cache,
            steps.out,
            step=self.plan,
            derive=lambda plan: {"plan": plan},
        )
        return steps.out

    def step(self, number: int, *, update: bool = True):
        self.plan = self.steps.plan(number)
        if update and self.wrapper.has_graph(KEY):
            self.tasks.update(KEY, self.plan)
        with graph_dispatch(RuntimeMode.FULL, key=KEY):
            return self.wrapper(self.steps.query)

    def step_replay_first(self, number: int):
        """Step ``number`` through ``replay_step``: the npu backend launches the replay,
        then updates its task."""
        self.plan = self.steps.plan(number)
        return self.wrapper.replay_step(KEY, self.plan)


def _run_two_steps(backend: NpuGraphBackend) -> tuple[Steps, DecodeModel]:
    steps = Steps()
    model = DecodeModel(steps, backend)
    out = model.step(1)  # warm-up, capture, replay
    assert max_error(out, steps.expected(1)) < TOLERANCE
    steps.query.copy_(steps.write_step(2, generator_seed=1))
    out = model.step(2)  # task update, replay
    assert max_error(out, steps.expected(2)) < TOLERANCE
    return steps, model


def test_capture_update_replay_follow_the_protocol(stand_in) -> None:
    _, model = _run_two_steps(NpuGraphBackend())
    names = stand_in.log.names()
    for call in (
        "torch.npu.graph.__call__",
        "torch.npu.ExternalEvent.wait",
        "torch.npu.ExternalEvent.reset",
        "torch.npu.graph_task_group_begin",
        "torch.npu.graph_task_group_end",
        "torch.npu.graph_task_update_begin",
        "torch.npu.graph_task_update_end",
        "torch.npu.ExternalEvent.record",
        "torch.npu.NPUGraph.replay",
        "torch.npu.Stream.wait_event",
    ):
        assert call in names, call
    assert "torch.npu.synchronize" not in names
    assert model.wrapper.entry(KEY).replays == 2
    (update,) = stand_in.log.of("torch.npu.graph_task_update_begin")
    capture_stream = model.wrapper.stream
    assert update.arguments["stream"] is not capture_stream


def test_replay_without_update_is_stale(stand_in) -> None:
    steps = Steps()
    model = DecodeModel(steps, NpuGraphBackend())
    model.step(1)
    steps.query.copy_(steps.write_step(2, generator_seed=1))
    out = model.step(2, update=False)
    assert max_error(out, steps.expected(2)) > 10 * TOLERANCE


def test_replay_launched_before_its_update_replays_the_update(stand_in) -> None:
    steps = Steps()
    model = DecodeModel(steps, NpuGraphBackend())
    model.step(1)  # capture (and its first replay, released)
    steps.query.copy_(steps.write_step(2, generator_seed=1))
    first = len(stand_in.log.calls)
    out = model.step_replay_first(2)
    assert max_error(out, steps.expected(2)) < TOLERANCE
    calls = [call.name for call in stand_in.log.calls[first:]]
    replay = calls.index("torch.npu.NPUGraph.replay")
    update_begin = calls.index("torch.npu.graph_task_update_begin")
    update_end = calls.index("torch.npu.graph_task_update_end")
    record = calls.index("torch.npu.ExternalEvent.record")
    assert replay < update_begin < update_end < record
    assert "torch.npu.synchronize" not in calls
    assert not stand_in.npu.runtime.held_replays()


class WaitsForTheLaunchedReplay(NpuGraphBackend):
    """Orders the update after the replay it updates (which waits for the update)."""

    def update_tasks_after_replay(self, graph, updates) -> None:
        self._issue_updates(self._update_stream_after(self._replays), updates)


def test_update_waiting_for_the_launched_replay_is_caught(stand_in) -> None:
    steps = Steps()
    model = DecodeModel(steps, WaitsForTheLaunchedReplay())
    model.step(1)
    steps.query.copy_(steps.write_step(2, generator_seed=1))
    with pytest.raises(SchemaViolation, match="deadlock"):
        model.step_replay_first(2)


class UpdateOnCaptureStream(NpuGraphBackend):
    """Issues task updates on the capture stream."""

    capture_stream = None

    def _update_stream_after(self, replay):
        return self.capture_stream


class UpdateWithoutEvent(NpuGraphBackend):
    """Updates tasks but never records their ExternalEvent after the update (a replay
    without update is released)."""

    def update_tasks(self, graph, updates) -> None:
        stream = self._update_stream_after(self._replays)
        with self.use_stream(stream):
            for handle, issue in updates:
                if issue is None:
                    handle.event.record(stream)
                    continue
                self._torch_npu().graph_task_update_begin(stream, handle.group)
                issue()
                self._torch_npu().graph_task_update_end(stream)

    @staticmethod
    def _torch_npu():
        import torch

        return torch.npu


class UpdateOffTheUpdateStream(NpuGraphBackend):
    """Brackets the update on the update stream but issues the op on the current one."""

    def use_stream(self, stream):
        import contextlib

        return contextlib.nullcontext()

    def update_tasks(self, graph, updates) -> None:
        import torch

        stream = self._update_stream_after(self._replays)
        for handle, issue in updates:
            if issue is not None:
                torch.npu.graph_task_update_begin(stream, handle.group)
                issue()
                torch.npu.graph_task_update_end(stream)
            handle.event.record(stream)


@pytest.mark.parametrize(
    ("backend_class", "message"),
    [
        (UpdateOnCaptureStream, "update stream must differ from the capture stream"),
        (UpdateWithoutEvent, "ExternalEvent was not recorded"),
        (UpdateOffTheUpdateStream, "not the update stream"),
    ],
)
def test_faulty_backend_is_caught(stand_in, backend_class, message) -> None:
    backend = backend_class()
    steps = Steps()
    model = DecodeModel(steps, backend)
    if backend_class is UpdateOnCaptureStream:
        backend.capture_stream = model.wrapper.stream
    model.step(1)
    steps.query.copy_(steps.write_step(2, generator_seed=1))
    with pytest.raises((SchemaViolation, GraphCaptureError), match=message):
        model.step(2)


def test_every_torch_npu_call_site_of_the_backend_is_checked(stand_in) -> None:
    backend = NpuGraphBackend()
    _run_two_steps(backend)
    backend.synchronize()
    backend.memory_in_use()
    with backend.use_stream(backend.new_stream()):
        backend.current_stream()
    backend.new_event()
    assert not backend.is_capturing()
    graph = backend.new_graph()
    with backend.capture(graph, pool=backend.new_pool(), stream=backend.new_stream()):
        assert backend.is_capturing()
        with backend.join_capture():
            pass
    sites = calls_through(Path(npu_backend_module.__file__), {"torch.npu"}, set())
    called = {
        name.removeprefix("torch.npu.").removesuffix(".__call__") for name in stand_in.log.names()
    }
    assert sites, "no torch.npu call site found in the npu backend"
    assert sites <= called, sorted(sites - called)
