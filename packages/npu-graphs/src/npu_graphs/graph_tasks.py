"""The updatable tasks of one captured graph, and how each step reaches them.

A task is ``fn(*args, **kwargs, **derive(step))`` (``derive(step[name])`` for a task
recorded with a ``name``) as it was captured: its static
arguments, its host step values (re-issued through the backend's task update, or baked
into the graph where the backend has none) and its fixed buffers (device tensors
handed to it at capture; each update copies the step's tensors into them).
:class:`GraphTasks` brings all tasks of one graph to a step (``update``) or lets a
replay go ahead with the values they have (``release``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from npu_graphs.backends.base import GraphBackend, TaskUpdate
from npu_graphs.errors import TaskUpdateError

Derive = Callable[[Any], Mapping[str, Any]]


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

    def step_kwargs(self, step: Any) -> Mapping[str, Any]:
        """The task's step keyword arguments for an update's ``step``: ``derive(step)``,
        or ``derive(step[name])`` for a named task.

        Raises:
            TaskUpdateError: a named task's entry is missing from ``step``.
        """
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

    def update(self, step: Any) -> None:
        """Bring every task to ``step``: re-issue its host values, copy its buffers.

        Raises:
            TaskUpdateError: a step value does not fit what was captured.
        """
        copied: set[int] = set()
        updates: list[TaskUpdate] = []
        for index, task in enumerate(self.tasks):
            kwargs = task.step_kwargs(step)
            self._copy_buffers(index, task, kwargs, copied)
            host = {name: kwargs[name] for name in task.host_names}
            if task.handle is not None:
                updates.append((task.handle, task.issue(host)))
            else:
                self._check_baked(index, task, host)
        if updates:
            self.backend.update_tasks(self.graph, updates)
        self.armed = True

    def release(self) -> None:
        """Let the next replay run the tasks' current values (if no update armed them)."""
        if self.armed:
            return
        handles = [(t.handle, None) for t in self.tasks if t.handle is not None]
        if handles:
            self.backend.update_tasks(self.graph, handles)
        self.armed = True

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
