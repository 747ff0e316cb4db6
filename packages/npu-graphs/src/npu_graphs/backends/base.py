"""The small interface every graph backend implements (npu, cuda, host)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

# One task update for :meth:`GraphBackend.update_tasks`: the task group handle and a
# callable that re-issues the task's op with new host arguments (its ``host_values``
# attribute holds them as keyword arguments), or ``None`` to let the next replay go
# ahead with the arguments the task already has.
TaskUpdate = tuple[Any, "Callable[[], object] | None"]


class GraphBackend(abc.ABC):
    """Device graphs of one kind: capture, replay, memory pool, streams, events, task groups.

    A *task group* brackets one op inside a capture so that the op's host arguments
    can later be replaced without a new capture (``update_tasks``). Backends whose
    graphs cannot do that (CUDA) report ``supports_task_update = False``; an updatable
    task then keeps its step state in fixed device buffers (see ``TaskRegistry``).
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    supports_task_update: ClassVar[bool]
    # Whether graph outputs are handed out as non-owning views of the graph pool.
    weak_ref_outputs: ClassVar[bool] = False
    # Whether capturing also executes the work (host) or only records it (devices).
    capture_executes: ClassVar[bool] = False
    # Eager runs a callable needs before its first capture (lazy library init on devices).
    warmup_runs: ClassVar[int] = 0
    # Whether an updatable task is recorded as one op (``record_task``) rather than as
    # the ops it issues between ``task_group_begin`` and ``task_group_end``.
    records_tasks_whole: ClassVar[bool] = False
    # Whether ``replay`` returns the graph's outputs afresh after ``finish_capture``
    # (host) instead of refreshing the tensors the capture returned (devices).
    replay_returns_outputs: ClassVar[bool] = False
    # Whether ``replay`` reads the tensors it is given as the graph's inputs (host)
    # instead of the addresses captured (devices: callers pass static buffers).
    replay_takes_inputs: ClassVar[bool] = False
    # Whether a replay may be launched before the update of its tasks
    # (``update_tasks_after_replay``): each captured task group waits on the device until
    # its update releases it (NPU: an ExternalEvent wait captured before the group), so
    # the host launches the replay first and the update overlaps the graph's work up to
    # the first task. Backends whose replay runs its tasks with the arguments they hold
    # at launch (host) or that have no task update (CUDA) update before the replay.
    # ``GraphWrapper.replay_step`` takes the order this names.
    updates_follow_replay: ClassVar[bool] = False

    # -- graphs ---------------------------------------------------------------------
    @abc.abstractmethod
    def new_graph(self) -> Any:
        """A fresh, empty graph object."""

    @abc.abstractmethod
    def new_pool(self) -> Any:
        """A memory-pool handle that several graphs can share."""

    @abc.abstractmethod
    def capture(self, graph: Any, *, pool: Any, stream: Any) -> contextlib.AbstractContextManager:
        """Context manager: work issued inside it is captured into ``graph``."""

    def finish_capture(self, graph: Any, outputs: Any, inputs: Sequence[torch.Tensor] = ()) -> None:
        """Called once a capture succeeded, with what it returned and the tensors it was
        called with: a backend whose graphs own their intermediates may release all but
        ``outputs`` (device pools do not)."""
        return None

    @abc.abstractmethod
    def replay(self, graph: Any, inputs: Sequence[torch.Tensor] | None = None) -> Any:
        """Launch the captured work of ``graph`` on the current stream; returns the
        outputs if ``replay_returns_outputs``, else ``None``. ``inputs``: this call's
        tensors, in capture order (read only where ``replay_takes_inputs``)."""

    @abc.abstractmethod
    def is_capturing(self) -> bool:
        """True while a capture of this backend is under way in this process."""

    def join_capture(self) -> contextlib.AbstractContextManager:
        """Context manager for a worker thread that issues work into an ongoing capture."""
        return contextlib.nullcontext()

    def suppress_cache_flush(self) -> contextlib.AbstractContextManager:
        """Context manager that turns the allocator's ``empty_cache`` into a no-op."""
        return contextlib.nullcontext()

    # -- streams and events ----------------------------------------------------------
    @abc.abstractmethod
    def new_stream(self) -> Any:
        """A new stream of this backend's device."""

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The stream work is issued on now."""

    @abc.abstractmethod
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context manager that makes ``stream`` the current stream."""

    @abc.abstractmethod
    def new_event(self) -> Any:
        """A new event (no timing)."""

    def record_event(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream``."""
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event``."""
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        """Make later work on ``stream`` wait for all work issued so far on ``other``."""
        stream.wait_stream(other)

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until the device is idle (setup and teardown only, never per step)."""

    # -- task groups -----------------------------------------------------------------
    def task_group_begin(self, graph: Any, stream: Any) -> Any:
        """Open a task group inside a capture; returns a token for ``task_group_end``."""
        raise NotImplementedError(f"the {self.name} backend has no task groups")

    def task_group_end(self, graph: Any, stream: Any, token: Any) -> Any:
        """Close the task group opened with ``token``; returns its update handle."""
        raise NotImplementedError(f"the {self.name} backend has no task groups")

    def record_task(
        self,
        graph: Any,
        stream: Any,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        host_values: Mapping[str, Any],
    ) -> tuple[Any, Any]:
        """Run and record ``fn`` as one task (``records_tasks_whole`` backends only).

        Returns ``(result, handle)``; ``update_tasks`` takes the handle like a task group's.
        """
        raise NotImplementedError(f"the {self.name} backend records tasks as task groups")

    def update_tasks(self, graph: Any, updates: Sequence[TaskUpdate]) -> None:
        """Re-issue (or release) task groups of ``graph`` before its next replay.

        Ordered against the previous replay and the next one by events or stream
        waits; never a device-wide synchronize.
        """
        raise NotImplementedError(f"the {self.name} backend has no task update")

    def update_tasks_after_replay(self, graph: Any, updates: Sequence[TaskUpdate]) -> None:
        """Re-issue (or release) task groups of ``graph`` for the replay of it just
        launched, whose task groups wait for it (``updates_follow_replay`` backends only).

        Ordered after the replay before that one (its tasks may still run), never after
        the launched one (it waits for this update); never a device-wide synchronize.
        """
        raise NotImplementedError(f"the {self.name} backend updates tasks before their replay")

    # -- memory and tensors ----------------------------------------------------------
    @abc.abstractmethod
    def memory_in_use(self) -> int:
        """Bytes of device memory in use (graph pools included), for capture reports."""

    def memory_breakdown(self) -> tuple[int, int]:
        """``(own, pool)``: bytes the graphs keep for themselves, and bytes of the pool
        their replays share. Backends that cannot tell them apart report all as own."""
        return self.memory_in_use(), 0

    def is_device_tensor(self, value: object) -> bool:
        """True for tensors on this backend's device (step state kept in fixed buffers)."""
        return isinstance(value, torch.Tensor) and value.device.type == self.device_type

    def weak_ref(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of ``tensor`` that does not keep its memory alive (identity if unsupported)."""
        return tensor

    def max_graphs(self, num_layers: int) -> int | None:
        """How many graphs of a ``num_layers`` model fit the device's resources (None: no limit)."""
        return None
