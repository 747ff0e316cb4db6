"""GraphWrapper: capture a callable per batch key on first sight, replay it after."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch.utils._pytree import tree_leaves, tree_map

from npu_graphs.backends import GraphBackend, get_backend
from npu_graphs.errors import GraphCaptureError
from npu_graphs.modes import RuntimeMode, current_dispatch
from npu_graphs.session import CaptureSession, active_session, capture_session
from npu_graphs.tasks import TaskRecording, TaskRegistry

logger = logging.getLogger(__name__)

_POOLS: dict[int, Any] = {}
_CAPTURE_STREAMS: dict[int, Any] = {}


def shared_pool(backend: GraphBackend) -> Any:
    """The process-wide graph memory pool of ``backend`` (created on first use)."""
    pool = _POOLS.get(id(backend))
    if pool is None:
        pool = _POOLS[id(backend)] = backend.new_pool()
    return pool


def shared_capture_stream(backend: GraphBackend) -> Any:
    """The one stream every capture of ``backend`` runs on (pool sharing needs one stream)."""
    stream = _CAPTURE_STREAMS.get(id(backend))
    if stream is None:
        stream = _CAPTURE_STREAMS[id(backend)] = backend.new_stream()
    return stream


@contextlib.contextmanager
def capture_quietly(backend: GraphBackend) -> Iterator[None]:
    """Suppress garbage collection and allocator cache flushes for the enclosed captures."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with mock.patch("gc.collect", lambda *a, **k: 0), backend.suppress_cache_flush():
            yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class GraphEntry:
    """One captured graph: its key, outputs, input addresses and task registries."""

    key: Hashable
    graph: Any
    outputs: Any
    input_addresses: tuple[int, ...]
    registries: tuple[TaskRegistry, ...] = field(default_factory=tuple)
    replays: int = 0


class GraphWrapper:
    """Wrap ``runnable`` so that it is captured per batch key and replayed after.

    On each call the wrapper reads :func:`~npu_graphs.current_dispatch`. It runs
    ``runnable`` eagerly when the mode is NONE, is not ``mode``, or another capture is
    under way (its work then becomes part of that capture: wrappers nest). Otherwise it
    captures on the first call for a key and replays the graph on later calls,
    returning the outputs captured for that key.

    The caller owns the inputs: every call for one key must pass tensors at the same
    addresses (static buffers sliced to the key's size); ``debug_check_addresses``
    checks that on each replay. Step state that changes per step reaches captured ops
    through updatable tasks (``tasks`` / :func:`~npu_graphs.call_task`): a replay with
    its step is :meth:`replay_step`, which orders the update and the replay as the
    backend takes them.

    Outputs: on backends with ``weak_ref_outputs`` (CUDA), outputs are non-owning views
    of the shared graph pool, valid until the next replay or capture of any graph in
    that pool; consume or copy them first. Host graphs return each replay's own
    tensors (``replay_returns_outputs``); the same rule of use applies.

    Args:
        runnable: the callable to capture (a model, a piece of one, a step function).
        backend: a GraphBackend, or a name/device for :func:`~npu_graphs.get_backend`.
        mode: the RuntimeMode this wrapper captures under (FULL or PIECEWISE).
        pool: graph memory pool; default: the backend's process-wide shared pool.
        tasks: registry that :func:`~npu_graphs.call_task` records into during captures.
        name: used in logs and errors.
        debug_check_addresses: compare input tensor addresses with the capture's on
            every replay (costs host time; for debugging).
        stream: capture stream; default: the backend's shared capture stream.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        *,
        backend: GraphBackend | str | torch.device | None = None,
        mode: RuntimeMode = RuntimeMode.FULL,
        pool: Any = None,
        tasks: TaskRegistry | None = None,
        name: str | None = None,
        debug_check_addresses: bool = False,
        stream: Any = None,
    ) -> None:
        if not callable(runnable):
            raise TypeError(f"runnable must be callable, got {type(runnable).__name__}")
        if not isinstance(mode, RuntimeMode) or mode is RuntimeMode.NONE:
            raise ValueError(f"mode must be RuntimeMode.FULL or PIECEWISE, got {mode!r}")
        if tasks is not None and not isinstance(tasks, TaskRegistry):
            raise TypeError(f"tasks must be a TaskRegistry or None, got {type(tasks).__name__}")
        self.runnable = runnable
        self.backend = get_backend(backend)
        self.mode = mode
        self.pool = pool if pool is not None else shared_pool(self.backend)
        self.tasks = tasks
        self.name = name or getattr(runnable, "__name__", type(runnable).__name__)
        self.debug_check_addresses = debug_check_addresses
        self.stream = stream if stream is not None else shared_capture_stream(self.backend)
        self._entries: dict[Hashable, GraphEntry] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = current_dispatch()
        if state.mode is not self.mode or active_session() is not None:
            return self.runnable(*args, **kwargs)
        entry = self._entries.get(state.key)
        if entry is None:
            entry = self.capture(state.key, *args, **kwargs)
            if self.backend.capture_executes:
                outputs = entry.outputs
                if self.backend.replay_returns_outputs:
                    entry.outputs = None  # replays return their own; let these go
                return outputs
        elif self.debug_check_addresses:
            _check_addresses(self.name, entry, args, kwargs)
        return self.replay(entry.key, *args, **kwargs)

    # -- capture ----------------------------------------------------------------------
    def capture(self, key: Hashable, *args: Any, **kwargs: Any) -> GraphEntry:
        """Capture ``runnable(*args, **kwargs)`` as the graph for ``key``.

        Raises:
            ValueError: ``key`` already has a graph.
            GraphCaptureError: the capture failed; nothing of it stays registered.
        """
        if key in self._entries:
            raise ValueError(f"{self.name}: key {key!r} is already captured; reset() it first")
        graph = self.backend.new_graph()
        session = CaptureSession(self.backend, graph, key, self.mode, self.stream, self.name)
        recording = TaskRecording(session, self.tasks)
        try:
            for _ in range(self.backend.warmup_runs):
                self.runnable(*args, **kwargs)
            outputs = self._run_capture(recording, args, kwargs)
            recording.commit()
        except Exception as exc:
            recording.discard()
            raise GraphCaptureError(
                f"capture of {self.name} for key {key!r} in mode {self.mode.name} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self.backend.finish_capture(graph, outputs, _tensors(args, kwargs))
        if self.backend.weak_ref_outputs:
            outputs = tree_map(_weak(self.backend), outputs)
        entry = GraphEntry(key, graph, outputs, _addresses(args, kwargs), recording.registries)
        self._entries[key] = entry
        logger.debug("captured %s for key %r (%s)", self.name, key, self.mode.name)
        return entry

    def _run_capture(self, recording: TaskRecording, args: tuple, kwargs: dict) -> Any:
        with contextlib.ExitStack() as stack:
            stack.enter_context(capture_quietly(self.backend))
            stack.enter_context(capture_session(recording.session))
            stack.enter_context(recording.active())
            stack.enter_context(
                self.backend.capture(recording.session.graph, pool=self.pool, stream=self.stream)
            )
            return self.runnable(*args, **kwargs)

    # -- replay -----------------------------------------------------------------------
    def replay(self, key: Hashable, *args: Any, **kwargs: Any) -> Any:
        """Replay the graph of ``key`` (its tasks released if not updated); returns its outputs.

        ``args``/``kwargs``: this call's arguments; backends that read their inputs at
        replay (host) need them, device graphs read the captured addresses.

        Raises:
            KeyError: no graph for ``key``.
        """
        entry = self._entry_of(key)
        for registry in entry.registries:
            registry.prepare_replay(key, entry.graph)
        outputs = self._launch(entry, args, kwargs)
        for registry in entry.registries:
            registry.finish_replay(key, entry.graph)
        return outputs

    def replay_step(self, key: Hashable, step: Any, *args: Any, **kwargs: Any) -> Any:
        """Replay the graph of ``key`` with its tasks (in this wrapper's registry,
        ``tasks``) brought to ``step``, in the order the backend takes; returns the
        graph's outputs.

        * no task of ``key`` (or no registry): the replay alone; ``step`` is not read.
        * ``backend.updates_follow_replay`` (NPU) and no task of ``key`` takes fixed
          device buffers: the replay is launched first, then ``tasks.update(key, step)``
          runs on the backend's update stream while the replay's tasks wait on the device
          for it (each released by its event); tasks the step leaves alone are released
          after it.
        * otherwise ``tasks.update(key, step)`` first (CUDA: a copy into the fixed
          buffers the graph reads; host: the recorded ops' arguments), then the replay.

        ``args``/``kwargs``: this call's arguments (host graphs read their inputs at
        replay; device graphs read the captured addresses).

        Raises:
            KeyError: no graph for ``key``.
            TaskUpdateError: ``step`` does not fit what ``key`` captured.
        """
        entry = self._entry_of(key)
        tasks = self.tasks
        if tasks is None or not tasks.num_tasks(key):
            return self.replay(key, *args, **kwargs)
        if not self.backend.updates_follow_replay or tasks.has_fixed_buffers(key):
            tasks.update(key, step)
            return self.replay(key, *args, **kwargs)
        for registry in entry.registries:
            if registry is not tasks:
                registry.prepare_replay(key, entry.graph)
        outputs = self._launch(entry, args, kwargs)
        try:
            with tasks.after_replay(key, entry.graph):
                tasks.update(key, step)
        finally:
            for registry in entry.registries:
                registry.finish_replay(key, entry.graph)
        return outputs

    def _entry_of(self, key: Hashable) -> GraphEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"{self.name}: no graph captured for key {key!r}")
        return entry

    def _launch(self, entry: GraphEntry, args: tuple, kwargs: dict) -> Any:
        """The backend's replay of ``entry``; its outputs."""
        if self.backend.replay_takes_inputs:
            outputs = self.backend.replay(entry.graph, _tensors(args, kwargs))
        else:
            outputs = self.backend.replay(entry.graph)
        entry.replays += 1
        return outputs if self.backend.replay_returns_outputs else entry.outputs

    # -- bookkeeping ------------------------------------------------------------------
    def has_graph(self, key: Hashable) -> bool:
        """True if a graph is captured for ``key``."""
        return key in self._entries

    def keys(self) -> list[Hashable]:
        """Captured keys, in capture order."""
        return list(self._entries)

    def entry(self, key: Hashable) -> GraphEntry:
        """The :class:`GraphEntry` of ``key`` (KeyError if none)."""
        return self._entries[key]

    def reset(self, keys: Sequence[Hashable] | None = None) -> None:
        """Drop the graphs of ``keys`` (all if None) and their tasks."""
        for key in list(self._entries) if keys is None else keys:
            entry = self._entries.pop(key, None)
            if entry is not None:
                for registry in entry.registries:
                    registry.discard(key, entry.graph)

    def unwrap(self) -> Callable[..., Any]:
        """The wrapped callable."""
        return self.runnable

    def __getattr__(self, name: str) -> Any:
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(name)
        return getattr(runnable, name)

    def __repr__(self) -> str:
        return (
            f"GraphWrapper({self.name}, mode={self.mode.name}, backend={self.backend.name}, "
            f"graphs={len(self._entries)})"
        )


def _weak(backend: GraphBackend) -> Callable[[Any], Any]:
    return lambda x: backend.weak_ref(x) if isinstance(x, torch.Tensor) else x


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


def _addresses(args: tuple, kwargs: dict) -> tuple[int, ...]:
    return tuple(
        x.data_ptr() if isinstance(x, torch.Tensor) else -1 for x in tree_leaves((args, kwargs))
    )


def _check_addresses(name: str, entry: GraphEntry, args: tuple, kwargs: dict) -> None:
    now = _addresses(args, kwargs)
    if len(now) != len(entry.input_addresses):
        raise ValueError(
            f"{name}: key {entry.key!r} was captured with {len(entry.input_addresses)} "
            f"argument leaves, called with {len(now)}"
        )
    for index, (captured, given) in enumerate(zip(entry.input_addresses, now)):
        if captured != given:
            raise ValueError(
                f"{name}: input {index} of key {entry.key!r} is at {given:#x}, the graph reads "
                f"{captured:#x}; pass the same static buffers on every call of a key"
            )
