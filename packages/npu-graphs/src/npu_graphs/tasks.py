"""Updatable tasks: ops captured into a graph whose step arguments change every step.

A task is ``fn(*args, **kwargs, **derive(step))``: ``args``/``kwargs`` are static
(weights, KV cache, output buffers), ``derive(step)`` gives the step arguments
(sequence lengths, block tables ...) from one step object shared by every task of the
step, or, for a task recorded with a ``name``, from the step's entry of that name (one
step object per layer, say: ``update(key, {name: step})``). Inside a capture the call
is recorded under the graph's key; outside one it just runs. Once per step, before
replay, ``registry.update(key, step)`` brings every task of that key's graphs to the
new step:

* host values (ints, lists, host tensors) are re-issued through the backend's task
  update (NPU task groups; host graphs). CUDA graphs cannot do that: a task meant for
  CUDA takes its step state as device tensors only.
* device tensors handed to tasks at capture are their fixed buffers (FlashInfer's
  caller-owned buffers: allocate them outside the capture, as step inputs are); the
  registry keeps them alive and each update copies the new step's tensors into them
  (tasks handed the same tensor share one buffer and one copy; a step that passes the
  buffer itself costs no copy).

Micro-batches: a task recorded inside micro-batch ``i`` of an overlapped capture
(:func:`micro_batch_scope`, entered by ``MicroBatchRunner``) takes entry ``i`` of a
:class:`PerMicroBatch` step, so that each micro-batch's tasks get that micro-batch's
own step (its plan, say) while the graph holds both; a plain step is shared by all.

During a capture the tasks go to a :class:`TaskRecording`, which the capturing
wrapper commits to each registry when the capture succeeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import torch

from npu_graphs.backends.base import GraphBackend, TaskUpdate
from npu_graphs.errors import GraphCaptureError, TaskUpdateError
from npu_graphs.session import CaptureSession, active_session

Derive = Callable[[Any], Mapping[str, Any]]


class PerMicroBatch(tuple):
    """One step per micro-batch of an overlapped graph: the tasks recorded inside
    micro-batch ``i`` take entry ``i`` (see :func:`micro_batch_scope`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"PerMicroBatch({list(self)!r})"


_SCOPE = threading.local()


@contextlib.contextmanager
def micro_batch_scope(index: int) -> Iterator[None]:
    """Tasks recorded by this thread in the enclosed block belong to micro-batch
    ``index``: each update hands them entry ``index`` of a :class:`PerMicroBatch` step.

    Raises:
        ValueError: ``index`` is not an int >= 0.
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"a micro-batch index is an int >= 0, got {index!r}")
    previous = getattr(_SCOPE, "index", None)
    _SCOPE.index = index
    try:
        yield
    finally:
        _SCOPE.index = previous


def current_micro_batch() -> int | None:
    """The micro-batch this thread records tasks for, or None outside micro-batches."""
    return getattr(_SCOPE, "index", None)


@dataclasses.dataclass
class UpdatableTask:
    """One captured task: the op, its static arguments, and how its step arguments are fed."""

    fn: Callable[..., Any]
    args: tuple | None  # None: recorded whole by its backend, updated by host values only
    kwargs: dict[str, Any] | None
    derive: Derive | None
    handle: Any  # backend task-group handle; None when the task has no host step values
    host_names: tuple[str, ...]
    buffers: dict[str, torch.Tensor]
    baked: dict[str, Any]  # host values as captured, where the backend cannot update them
    name: str | None = None  # the task takes step[name] of each update's step
    micro_batch: int | None = None  # recorded in this micro-batch: takes its PerMicroBatch entry

    def step_kwargs(self, step: Any) -> Mapping[str, Any]:
        """The task's step keyword arguments for an update's ``step``: ``derive(step)``,
        or ``derive(step[name])`` for a named task; a task of micro-batch ``i`` first
        takes entry ``i`` of a :class:`PerMicroBatch` step.

        Raises:
            TaskUpdateError: a named task's entry is missing from ``step``, or a
                :class:`PerMicroBatch` step has no entry for the task's micro-batch
                (or the task was recorded outside micro-batches).
        """
        if isinstance(step, PerMicroBatch):
            if self.micro_batch is None or self.micro_batch >= len(step):
                where = (
                    "outside micro-batches"
                    if self.micro_batch is None
                    else f"in micro-batch {self.micro_batch}"
                )
                raise TaskUpdateError(
                    f"task {self.name!r} was recorded {where}; the update brought steps "
                    f"for {len(step)} micro-batches"
                )
            step = step[self.micro_batch]
        if self.name is not None:
            if not isinstance(step, Mapping) or self.name not in step:
                got = sorted(step)[:4] if isinstance(step, Mapping) else type(step).__name__
                raise TaskUpdateError(
                    f"task {self.name!r} takes the step's entry {self.name!r}, but the step "
                    f"has none (got {got})"
                )
            step = step[self.name]
        return step_kwargs(self.derive, step)

    def issue(self, host_values: Mapping[str, Any]) -> TaskIssue:
        """A callable that re-issues the op with ``host_values`` and the fixed buffers."""
        return TaskIssue(self, host_values)


class TaskIssue:
    """Re-issues one task with new host values when called (inside a backend's task update).

    ``host_values`` is exposed too, for backends that record tasks whole and swap their
    host arguments instead of re-issuing them (``records_tasks_whole``: host graphs).
    """

    __slots__ = ("host_values", "task")

    def __init__(self, task: UpdatableTask, host_values: Mapping[str, Any]) -> None:
        self.task, self.host_values = task, host_values

    def __call__(self) -> object:
        task = self.task
        if task.args is None:
            raise RuntimeError(
                "this task was recorded whole: its backend updates it through host_values "
                "and never re-issues it"
            )
        return task.fn(*task.args, **task.kwargs, **self.host_values, **task.buffers)


@dataclasses.dataclass
class GraphTasks:
    """The tasks of one captured graph; ``armed`` once updated or released for a replay.

    While ``replay_issued`` (see :meth:`TaskRegistry.after_replay`), the replay they are
    updated for is already launched and waits for them on the device.

    Args:
        backend: the graph's backend (it re-issues or releases the tasks).
        graph: the captured graph.
        tasks: the graph's tasks, in capture order.
        label: names the tasks' registry in error messages.
    """

    backend: GraphBackend
    graph: Any
    tasks: list[UpdatableTask]
    label: str
    armed: bool = False
    replay_issued: bool = False

    def update(self, step: Any) -> None:
        """Bring every task to ``step``: re-issue its host values, copy its buffers.

        Raises:
            TaskUpdateError: a step value does not fit what was captured; or, for a
                replay already launched, a second update or a task with fixed device
                buffers (their copies must precede the replay on its stream).
        """
        if self.replay_issued and self.armed:
            raise TaskUpdateError(
                f"{self.label}: a second update for the replay already launched (the first "
                "one released its tasks)"
            )
        copied: set[int] = set()
        updates: list[TaskUpdate] = []
        for index, task in enumerate(self.tasks):
            kwargs = task.step_kwargs(step)
            if self.replay_issued and task.buffers:
                raise TaskUpdateError(
                    f"{self.label}: task {index} takes fixed device buffers "
                    f"{sorted(task.buffers)}, which must be filled before its replay is "
                    "launched; update it before the replay"
                )
            self._copy_buffers(index, task, kwargs, copied)
            host = {name: kwargs[name] for name in task.host_names}
            if task.handle is not None:
                updates.append((task.handle, task.issue(host)))
            else:
                self._check_baked(index, task, host)
        if updates:
            self._issue(updates)
        self.armed = True

    def release(self) -> None:
        """Let the next replay (or the one launched) run the tasks' current values, if
        no update armed them."""
        if self.armed:
            return
        handles = [(t.handle, None) for t in self.tasks if t.handle is not None]
        if handles:
            self._issue(handles)
        self.armed = True

    def _issue(self, updates: list[TaskUpdate]) -> None:
        if self.replay_issued:
            self.backend.update_tasks_after_replay(self.graph, updates)
        else:
            self.backend.update_tasks(self.graph, updates)

    def _copy_buffers(
        self, index: int, task: UpdatableTask, kwargs: Mapping[str, Any], copied: set[int]
    ) -> None:
        """Copy the step's device tensors into the task's fixed buffers (once per buffer)."""
        for name, buffer in task.buffers.items():
            if id(buffer) in copied:
                continue
            value = kwargs.get(name)
            if not isinstance(value, torch.Tensor) or value.shape != buffer.shape:
                got = (
                    tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                )
                raise TaskUpdateError(
                    f"{self.label}: task {index} step argument {name!r} must be a tensor of shape "
                    f"{tuple(buffer.shape)} (its fixed buffer), got {got}"
                )
            if value.data_ptr() != buffer.data_ptr():
                buffer.copy_(value, non_blocking=True)
            copied.add(id(buffer))

    def _check_baked(self, index: int, task: UpdatableTask, host: Mapping[str, Any]) -> None:
        """Refuse a host value that differs from the one baked into the graph."""
        for name, value in host.items():
            if not same_value(task.baked[name], value):
                raise TaskUpdateError(
                    f"{self.label}: task {index} step argument {name!r} is a host value baked "
                    "into the graph, and this backend cannot update it; pass it as a device "
                    "tensor (kept in a fixed buffer)"
                )


def step_kwargs(derive: Derive | None, step: Any) -> Mapping[str, Any]:
    """``derive(step)`` (``step`` itself without ``derive``), checked to be a Mapping.

    Raises:
        TypeError: it is not a Mapping of keyword arguments.
    """
    kwargs = step if derive is None else derive(step)
    if not isinstance(kwargs, Mapping):
        source = "step" if derive is None else "derive(step)"
        raise TypeError(
            f"{source} must be a Mapping of step keyword arguments, got {type(kwargs).__name__}"
        )
    return kwargs


def baked_copy(value: Any) -> Any:
    """A host step value as the capture baked it: host tensors and lists copied (callers
    refill theirs in place), other values kept as given."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (list, tuple):
        return type(value)(map(baked_copy, value))
    return value


def same_value(baked: Any, value: Any) -> bool:
    """Whether ``value`` equals the ``baked`` one: tensors by dtype, shape and values,
    lists and tuples item by item, anything else by ``==``."""
    if isinstance(baked, torch.Tensor) or isinstance(value, torch.Tensor):
        return (
            isinstance(baked, torch.Tensor)
            and isinstance(value, torch.Tensor)
            and (baked.dtype, baked.shape, baked.device) == (value.dtype, value.shape, value.device)
            and torch.equal(baked, value)
        )
    if type(baked) in (list, tuple):
        return (
            type(value) is type(baked)
            and len(value) == len(baked)
            and all(map(same_value, baked, value))
        )
    try:
        return type(value) is type(baked) and bool(value == baked)
    except (RuntimeError, ValueError):  # it holds tensors or arrays: == is elementwise
        return False


class TaskRegistry:
    """A set of updatable tasks per graph key, for one model (main or draft, say).

    Args:
        name: used in error messages.
        expected_tasks: if given, each captured graph must record exactly this many
            tasks in this registry (e.g. one per attention layer), else the capture fails.
    """

    def __init__(self, name: str = "tasks", *, expected_tasks: int | None = None) -> None:
        if expected_tasks is not None and (
            not isinstance(expected_tasks, int) or expected_tasks < 0
        ):
            raise ValueError(f"expected_tasks must be an int >= 0 or None, got {expected_tasks!r}")
        self.name = name
        self.label = f"task registry {name!r}"
        self.expected_tasks = expected_tasks
        self._graphs: dict[Hashable, list[GraphTasks]] = {}

    # -- recording ------------------------------------------------------------------
    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        step: Any,
        derive: Derive | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs, **derive(step))``; inside a capture, record it as a task.

        ``derive`` (default: ``step`` itself, which must then be a Mapping) must be cheap:
        it runs once per task per update. With ``name``, ``step`` is this task's own and
        each update hands the task ``step[name]`` of the step it is given (tasks may
        share a name: the ops of one layer, say).

        Raises:
            TypeError: ``fn`` is not callable, ``derive(step)`` is not a Mapping, or a
                name is given both as a static and as a step argument.
            GraphCaptureError: a task called inside another task's ``fn`` during a capture.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        recording = active_recording()
        if recording is None:
            return fn(*args, **kwargs, **step_kwargs(derive, step))
        return recording.record(self, fn, args, kwargs, step_kwargs(derive, step), derive, name)

    def commit_capture(self, session: CaptureSession, tasks: list[UpdatableTask]) -> None:
        """Keep ``tasks``, recorded by the capture ``session``, under its key.

        Raises:
            GraphCaptureError: their count is not ``expected_tasks``.
        """
        if self.expected_tasks is not None and len(tasks) != self.expected_tasks:
            raise GraphCaptureError(
                f"{self.label}: capture of {session.describe()} recorded {len(tasks)} tasks, "
                f"expected {self.expected_tasks}"
            )
        if tasks:
            graph_tasks = GraphTasks(session.backend, session.graph, tasks, self.label)
            self._graphs.setdefault(session.key, []).append(graph_tasks)

    def discard(self, key: Hashable, graph: Any = None) -> None:
        """Forget the tasks of ``key`` (of one ``graph`` only, if given)."""
        kept = [g for g in self._graphs.get(key, []) if graph is not None and g.graph is not graph]
        if kept:
            self._graphs[key] = kept
        else:
            self._graphs.pop(key, None)

    # -- per step -------------------------------------------------------------------
    def update(self, key: Hashable, step: Any) -> None:
        """Bring every task captured under ``key`` to ``step``; call once per step before
        replay (or right after it, inside :meth:`after_replay`).

        Every task is re-issued with the host values of ``step`` and its device tensors
        are copied into the task's fixed buffers.

        Raises:
            GraphCaptureError: called while a capture is under way.
            ValueError: no graph was captured under ``key`` in this registry.
            TaskUpdateError: a step value does not fit what was captured.
        """
        session = active_session()
        if session is not None:
            raise GraphCaptureError(
                f"{self.label}: update({key!r}) during the capture of {session.describe()}"
            )
        graphs = self._graphs.get(key)
        if graphs is None:
            raise ValueError(
                f"{self.label}: no graph captured for key {key!r}; captured keys: "
                f"{sorted(map(repr, self._graphs))}"
            )
        for graph_tasks in graphs:
            graph_tasks.update(step)

    @contextlib.contextmanager
    def after_replay(self, key: Hashable, graph: Any) -> Iterator[None]:
        """The replay of ``graph`` (captured under ``key``) is launched and its tasks wait
        on the device for their update (``updates_follow_replay`` backends): an
        ``update(key, step)`` in the enclosed block goes after the replay
        (``update_tasks_after_replay``). Tasks the block leaves alone, even when it
        raises, are released at its end, so that the replay never waits forever.
        """
        graphs = [g for g in self._graphs.get(key, ()) if g.graph is graph]
        for graph_tasks in graphs:
            graph_tasks.replay_issued = True
        try:
            yield
        finally:
            try:
                for graph_tasks in graphs:
                    graph_tasks.release()
            finally:
                for graph_tasks in graphs:
                    graph_tasks.replay_issued = False

    def has_fixed_buffers(self, key: Hashable) -> bool:
        """Whether a task of ``key`` takes fixed device buffers (each update fills them
        on the current stream, so it must precede the replay)."""
        return any(task.buffers for task in self.tasks(key))

    # -- replay hooks (called by the wrapper around each replay) -------------------------
    def prepare_replay(self, key: Hashable, graph: Any) -> None:
        """Make the tasks of ``graph`` ready: release them if they were not updated."""
        for graph_tasks in self._graphs.get(key, ()):
            if graph_tasks.graph is graph:
                graph_tasks.release()

    def finish_replay(self, key: Hashable, graph: Any) -> None:
        """Mark the tasks of ``graph`` as consumed by a replay."""
        for graph_tasks in self._graphs.get(key, ()):
            if graph_tasks.graph is graph:
                graph_tasks.armed = False

    # -- introspection ----------------------------------------------------------------
    def keys(self) -> list[Hashable]:
        """Keys with captured tasks."""
        return list(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def tasks(self, key: Hashable) -> list[UpdatableTask]:
        """All tasks captured under ``key`` (over every graph of that key)."""
        return [t for g in self._graphs.get(key, ()) for t in g.tasks]

    def num_tasks(self, key: Hashable) -> int:
        return len(self.tasks(key))

    def __repr__(self) -> str:
        return f"TaskRegistry({self.name!r}, keys={len(self._graphs)})"


class TaskRecording:
    """The updatable tasks one capture records, in every registry its callable reaches.

    The capturing wrapper makes one per capture, makes it ``active()`` while the
    capture runs, then ``commit()``s it (each registry keeps its tasks under the
    capture's key) or ``discard()``s it, as a whole.

    Args:
        session: the capture.
        default: the registry that :func:`call_task` records into (the wrapper's).
    """

    def __init__(self, session: CaptureSession, default: TaskRegistry | None = None) -> None:
        self.session = session
        self.default = default
        self._recorded: dict[int, tuple[TaskRegistry, list[UpdatableTask]]] = {}
        self._in_task = False

    @property
    def registries(self) -> tuple[TaskRegistry, ...]:
        """The registries that recorded tasks in this capture, in order of first task."""
        return tuple(registry for registry, _ in self._recorded.values())

    @contextlib.contextmanager
    def active(self) -> Iterator[TaskRecording]:
        """Record the tasks called in the enclosed block (inside the capture)."""
        global _ACTIVE
        assert _ACTIVE is None, "one capture at a time (capture_session enforces it)"
        _ACTIVE = self
        try:
            yield self
        finally:
            _ACTIVE = None

    def record(
        self,
        registry: TaskRegistry,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict[str, Any],
        step_values: Mapping[str, Any],
        derive: Derive | None,
        name: str | None = None,
    ) -> Any:
        """Issue ``fn(*args, **kwargs, **step_values)`` into the capture as a task of
        ``registry``; returns its result."""
        overlap = step_values.keys() & kwargs.keys()
        if overlap:
            raise TypeError(
                f"{registry.label}: {sorted(overlap)} given both as static and step arguments"
            )
        backend = self.session.backend
        host = {k: v for k, v in step_values.items() if not backend.is_device_tensor(v)}
        buffers = {k: v for k, v in step_values.items() if backend.is_device_tensor(v)}
        grouped = bool(host) and backend.supports_task_update
        with self._one_task(registry):
            result, handle = _issue(self.session, fn, args, {**kwargs, **buffers}, host, grouped)
        baked = {} if grouped else {k: baked_copy(v) for k, v in host.items()}
        # A backend that records tasks whole updates them by their host values alone:
        # keeping the capture-time arguments would keep the capture's activations alive.
        whole = backend.records_tasks_whole and grouped
        task = UpdatableTask(
            fn, None if whole else args, None if whole else dict(kwargs), derive, handle,
            tuple(host), buffers, baked, name, current_micro_batch(),
        )  # fmt: skip
        self._recorded.setdefault(id(registry), (registry, []))[1].append(task)
        return result

    @contextlib.contextmanager
    def _one_task(self, registry: TaskRegistry) -> Iterator[None]:
        """The enclosed block issues one task; a task issued inside it is refused."""
        if self._in_task:
            raise GraphCaptureError(f"{registry.label}: updatable tasks cannot nest")
        self._in_task = True
        try:
            yield
        finally:
            self._in_task = False

    def commit(self) -> None:
        """Hand each registry the tasks it recorded (the default registry's count is
        checked even when it recorded none).

        Raises:
            GraphCaptureError: a registry's task count is not its ``expected_tasks``.
        """
        recorded = dict(self._recorded)
        if self.default is not None:
            recorded.setdefault(id(self.default), (self.default, []))
        for registry, tasks in recorded.values():
            registry.commit_capture(self.session, tasks)

    def discard(self) -> None:
        """Forget every task of this capture, in registries that already kept them too."""
        for registry in self.registries:
            registry.discard(self.session.key, self.session.graph)


_ACTIVE: TaskRecording | None = None


def active_recording() -> TaskRecording | None:
    """The task recording of the capture under way, or None."""
    return _ACTIVE


def call_task(
    fn: Callable[..., Any],
    *args: Any,
    step: Any,
    derive: Derive | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn`` as an updatable task of the registry of the capture under way.

    Outside a capture this just runs ``fn(*args, **kwargs, **derive(step))``. Inside
    one, the task goes to the capturing wrapper's registry (its ``tasks`` argument).

    Raises:
        GraphCaptureError: inside a capture whose wrapper has no registry (the step
            arguments would be baked in silently).
    """
    recording = active_recording()
    if recording is None:
        return fn(*args, **kwargs, **step_kwargs(derive, step))
    if recording.default is None:
        raise GraphCaptureError(
            f"call_task inside the capture of {recording.session.describe()}, whose wrapper "
            "has no TaskRegistry: its step arguments would be baked into the graph"
        )
    return recording.default.call(fn, *args, step=step, derive=derive, name=name, **kwargs)


def _issue(
    session: CaptureSession,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    host: dict,
    grouped: bool,
) -> tuple[Any, Any]:
    """Run ``fn`` inside the capture: as one recorded task, in a task group, or plainly
    (no host step values, or a backend without task update). Returns (result, handle).

    The group brackets the stream the op is issued on: the capture stream, or a stream
    joined to the capture (a micro-batch's, say)."""
    backend, graph = session.backend, session.graph
    stream = backend.current_stream()
    if not grouped:
        return fn(*args, **kwargs, **host), None
    if backend.records_tasks_whole:
        return backend.record_task(graph, stream, fn, args, kwargs, host)
    token = backend.task_group_begin(graph, stream)
    result = fn(*args, **kwargs, **host)
    return result, backend.task_group_end(graph, stream, token)
