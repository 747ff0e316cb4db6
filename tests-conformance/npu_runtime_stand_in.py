"""A stand-in ``torch.npu`` runtime built from torch_npu's Python API.

Every call is bound to the signature read from torch_npu's own Python sources
(``graphs.py``, ``streams.py``, ``utils.py`` ...; see ``torch_npu_schemas``) and
recorded; a name ``torch.npu`` does not export raises ``SchemaViolation``. The
stand-in then models what the documentation says happens on the device, on CPU
tensors:

- Capture (``torch.npu.graph`` or ``NPUGraph.capture_begin``) records every op of
  the capture, with npu-graphs' host recording rules (its ``host`` backend's
  recorder: aten ops one by one, custom ops below, those registered whole as one
  op): the aten ops run at capture, as a host graph's do, while each torch_npu op
  is recorded whole and not run (out-form and in-place ops only: a captured op's
  result is not available at capture). ``replay`` runs the recording, aten ops
  included, on the captured tensors (a graph's tensors keep their addresses, as in
  a device pool), each torch_npu op with the host arguments it was captured or last
  updated with. Workspace sizing (``*_get_max_workspace``, ``*_get_workspace``) is
  host work and runs at once, unrecorded. Capturing on the default stream and a
  device synchronize during a capture fail. A graph holds one stream, and one more
  per task group; captures past the device's stream budget fail (torch_npu's error
  207005 on the NPU).
- Several streams in one capture (as torch_npu's capture of a model that forks
  streams): a stream joins the capture by waiting for captured work (``wait_stream``
  on a captured stream, or ``wait_event`` on an ``Event`` recorded on one); its ops
  are then captured (in issue order: the replay runs the graph's ops in the order the
  host issued them) and it may hold task groups. Work issued on a stream that has not
  joined fails, and so does a capture that ends before the capture stream has waited
  for every joined stream's last work (torch_npu's ``capture_end`` fails, 107025:
  "capture model contains a stream that was not joined to the original stream").
  The current stream is per host thread, as in torch_npu.
- Collectives: a ``torch.distributed`` collective (:data:`DIST_COLLECTIVES`: HCCL's on
  the NPU, gloo's here) called during a capture is recorded whole as one task of the
  graph, as torch_npu captures an HCCL collective; each replay calls it again on the
  captured tensors, to completion (a stream-ordered collective). Every rank replays its
  graphs step by step, so each issues the same collectives in the same order. A ``c10d``
  op reached otherwise during a capture is refused (recorded below, gloo's threads and
  completion would replay stale buffers).
- Task groups: ``graph_task_group_begin/end(stream)`` bracket ops on the capture
  stream and return a handle. ``graph_task_update_begin(stream, handle)`` ...
  ``graph_task_update_end(stream)`` must run on a stream other than the capture
  stream, with that stream current, re-issuing the same number and kind of ops on
  the tensors of their capture (same address, shape, strides and dtype); their host
  arguments replace the captured ones. Any other device work inside an update (an
  aten copy, an allocation, a computation: on the NPU it would run eagerly, outside
  the graph) is refused, naming the op; views (metadata only) pass.
- ``ExternalEvent``: captured ``wait`` + ``reset`` on the capture stream before a
  task group make the replay wait for it; after an update, ``record`` on the
  update stream releases it. Replaying a graph with an updated task group whose
  event was never recorded after the update fails: the replay could run before
  the update.
- A replay runs its ops in order up to the first task group whose events are not
  recorded and is *held* there (the captured wait), as torch_npu documents the wait
  ("blocks the stream until the event completes"); each ``record`` resumes it, and
  the group runs with the host arguments it has by then. So a replay may be launched
  before its update (the update then fills each group before releasing it). A later
  replay on the same stream queues behind a held one. What the stand-in refuses:
  a task update of a group its held replay already ran (the event was recorded
  before the update), a ``record`` on a stream that waits (``Event`` + ``wait_event``,
  or ``wait_stream``) for the very replay that record would release (a deadlock), a
  synchronize while a replay is held (it would never return), and a torch_npu op
  issued on a stream behind a held replay (not modeled). :meth:`NpuRuntime.held_replays`
  lists the replays still held.

Anything else torch.npu exports raises ``NotModeled`` (an ``AttributeError`` too:
``hasattr`` answers False). :attr:`NpuRuntime.stats` counts captures, replays, task
updates and synchronizes. Nothing in the packages imports this module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import inspect
import threading
import types
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from schema_stand_in import (
    Call,
    CallLog,
    Launcher,
    NotModeled,
    NotModeledAttribute,
    UnknownAttribute,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_mode_stack
from torch.utils._python_dispatch import _pop_mode as _pop_dispatch_mode
from torch_npu_schemas import PythonApi, SchemaViolation, bind_python

from npu_graphs.backends.host import _SHAPE_QUERIES, HostGraph, _kind_of, _Recorder
from npu_graphs.backends.host_program import Kind, Op, tensor_leaves
from npu_graphs.planner import NPU_STREAM_BUDGET

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
STREAM_ERROR = 207005  # torch_npu / ACL: out of stream resources


@dataclass(frozen=True)
class NpuCall:
    """A torch_npu op as a recorded graph op: ``call(**arguments)`` computes it."""

    name: str
    implementation: Callable[[dict[str, Any]], Any]

    def __call__(self, **arguments: Any) -> Any:
        return self.implementation(arguments)

    def __str__(self) -> str:
        return f"torch_npu.{self.name}"


@dataclass(eq=False)
class TaskGroup:
    """What ``graph_task_group_end`` hands out: the ops of one group of one graph
    (``start``: its first recorded op; ``op_indices``: its torch_npu ops)."""

    graph: StandInGraph
    start: int = 0
    op_indices: list[int] = field(default_factory=list)
    events: list[StandInExternalEvent] = field(default_factory=list)
    updated_on: StandInStream | None = None  # stream of the last update not yet replayed
    released: bool = False  # its event was recorded after that update


@dataclass
class _Capture:
    graph: StandInGraph
    stream: StandInStream
    recorders: dict[int, _Recorder] = field(default_factory=dict)  # host thread -> recorder
    # Per stream in the capture: the open task group, the ExternalEvents waited (-> reset).
    groups: dict[StandInStream, TaskGroup] = field(default_factory=dict)
    waited: dict[StandInStream, dict[StandInExternalEvent, bool]] = field(default_factory=dict)
    # Vector clocks of the captured streams: clocks[s][t] = ops of stream t that the work
    # issued next on s comes after (clocks[s][s]: ops issued on s so far).
    clocks: dict[StandInStream, dict[StandInStream, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.clocks[self.stream] = {self.stream: 0}

    def join(self, stream: StandInStream, clock: dict[StandInStream, int]) -> None:
        """Later work on ``stream`` comes after the captured work ``clock`` counts."""
        mine = self.clocks.setdefault(stream, {stream: 0})
        for other, ticks in clock.items():
            mine[other] = max(mine.get(other, 0), ticks)

    def unjoined(self) -> list[StandInStream]:
        """Captured streams whose last work the capture stream has not waited for."""
        final = self.clocks[self.stream]
        return [
            stream
            for stream, clock in self.clocks.items()
            if stream is not self.stream and final.get(stream, 0) < clock[stream]
        ]


@dataclass
class _Update:
    group: TaskGroup
    stream: StandInStream
    guard: _UpdateGuard
    issued: list[tuple[NpuCall, dict[str, Any]]] = field(default_factory=list)


@dataclass(eq=False)
class Replay:
    """One launched replay: the next op it runs, and whether it has finished."""

    graph: StandInGraph
    stream: StandInStream
    next_op: int = 0
    done: bool = False
    group_starts: dict[int, TaskGroup] = field(default_factory=dict)


class NpuRuntime(Launcher):
    """Device state shared by ``torch.npu`` and the torch_npu ops of one stand-in."""

    def __init__(self, api: PythonApi, log: CallLog) -> None:
        self.api, self.log = api, log
        self.classes = _bound_classes(self)
        self._thread = threading.local()  # each host thread's current stream
        self.default_stream = self.classes["Stream"].internal("default")
        self.side_stream: StandInStream | None = None
        self.capture: _Capture | None = None
        self.update: _Update | None = None
        self.queued: dict[StandInStream, list[Replay]] = {}  # launched, not finished
        self._streams = 0
        self.stream_budget = NPU_STREAM_BUDGET  # streams the device gives captured graphs
        self.graphs: weakref.WeakSet[StandInGraph] = weakref.WeakSet()  # captured, alive
        # captures, replays, task_updates, replayed_ops, synchronizes (device, stream),
        # event_synchronizes, captured_collectives, replayed_collectives
        self.stats: Counter = Counter()
        self._modes: set[TorchDispatchMode] = set()  # pushed by this runtime, not popped

    @property
    def current_stream(self) -> StandInStream:
        """This host thread's current stream (the default stream until it sets one)."""
        return getattr(self._thread, "stream", self.default_stream)

    @current_stream.setter
    def current_stream(self, stream: StandInStream) -> None:
        self._thread.stream = stream

    def captured_clock(self, stream: StandInStream) -> dict[StandInStream, int] | None:
        """The vector clock of ``stream`` if it is in the capture under way, else None."""
        capture = self.capture
        return None if capture is None else capture.clocks.get(stream)

    def held_replays(self) -> list[Replay]:
        """Replays launched and not finished (held at a task group, or queued behind one)."""
        return [replay for replays in self.queued.values() for replay in replays]

    def check_not_held(self, what: str) -> None:
        held = self.held_replays()
        if held:
            replay = held[0]
            raise SchemaViolation(
                f"{what} with a replay held on stream {replay.stream.name}: it waits at op "
                f"{replay.next_op} for a task group's ExternalEvent that is never recorded "
                "(no update or release after the replay), so this would never return"
            )

    def last_replay_on(self, stream: StandInStream) -> Replay | None:
        """The last unfinished replay launched on ``stream``, if any."""
        replays = self.queued.get(stream)
        return replays[-1] if replays else None

    def new_stream(self) -> StandInStream:
        self._streams += 1
        return self.classes["Stream"].internal(f"stream{self._streams}")

    def check(self, qualname: str, signature: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        arguments = bind_python(signature, qualname, args, kwargs)
        self.log.record(Call(qualname, arguments))
        return arguments

    def check_function(self, name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
        return self.check(f"torch.npu.{name}", self.api.function(name), args, kwargs)

    def check_method(self, cls: str, method: str, args: tuple, kwargs: dict) -> dict[str, Any]:
        signature = self.api.method(cls, method)
        return self.check(f"torch.npu.{cls}.{method}", signature, args, kwargs)

    def close(self) -> None:
        """Pop the dispatch modes a failed capture or update left on this thread's stack."""
        self.update = self.capture = None
        while any(mode in self._modes for mode in _dispatch_mode_stack()):
            self._modes.discard(_pop_dispatch_mode())

    def _push(self, mode: TorchDispatchMode) -> None:
        mode.__enter__()
        self._modes.add(mode)

    def _pop(self, mode: TorchDispatchMode) -> None:
        mode.__exit__(None, None, None)
        self._modes.discard(mode)

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """The stand-in's own work inside a capture: not recorded into the graph."""
        if self.capture is None:
            yield
            return
        host = self.capture.graph.host
        host._opaque.depth = host.opaque_depth + 1
        try:
            yield
        finally:
            host._opaque.depth -= 1

    # -- ops from the torch_npu stand-in --------------------------------------------
    def launch(self, name: str, implementation: Callable[[dict], Any], arguments: dict) -> Any:
        if name.endswith("_get_max_workspace") or "_get_workspace" in name:
            with self.unrecorded():  # host-side sizing, not a device task
                return implementation(arguments)
        call = NpuCall(name, implementation)
        if self.update is None and self.capture is None and self.queued.get(self.current_stream):
            raise NotModeled(
                f"torch_npu.{name} issued on stream {self.current_stream.name} behind a replay "
                "held by an ExternalEvent wait"
            )
        if self.update is not None:
            _expect(
                self.current_stream is self.update.stream,
                f"torch_npu.{name} re-issued for a task update on stream "
                f"{self.current_stream.name}, not the update stream {self.update.stream.name}",
            )
            self.update.issued.append((call, arguments))
            return _deferred_result(name, arguments)
        if self.capture is not None:
            stream = self.current_stream
            clock = self.capture.clocks.get(stream)
            _expect(
                clock is not None,
                f"torch_npu.{name} issued on stream {stream.name} during a capture on "
                f"{self.capture.stream.name}, and {stream.name} has not joined the capture "
                "(it must first wait for the capture stream's work)",
            )
            clock[stream] += 1
            result = _deferred_result(name, arguments)
            host = self.capture.graph.host
            host.append(Op(call, (), arguments, result, Kind.MUTATE))
            group = self.capture.groups.get(stream)
            if group is not None:
                group.op_indices.append(host.num_ops - 1)
            return result
        return implementation(arguments)

    # -- capture --------------------------------------------------------------------
    def begin_capture(self, graph: StandInGraph, stream: StandInStream, mode: str) -> None:
        _expect(self.capture is None, "a capture is already under way")
        _expect(
            mode in CAPTURE_ERROR_MODES,
            f"capture_error_mode={mode!r} is not one of {CAPTURE_ERROR_MODES}",
        )
        _expect(
            stream is not self.default_stream,
            "capture on the default stream; capture on "
            "a side stream (torch.npu.graph(..., stream=torch.npu.Stream()))",
        )
        graph.host, graph.groups, graph.captured = HostGraph(), [], False
        graph.capture_stream = stream
        self.capture = _Capture(graph, stream)
        self.join_recording()

    def join_recording(self) -> bool:
        """Record this host thread's ops into the capture under way; True if it joined
        now (False: no capture, or the thread records already)."""
        capture, thread = self.capture, threading.get_ident()
        if capture is None or thread in capture.recorders:
            return False
        recorder = _DeviceRecorder(capture.graph.host)
        self._push(recorder)
        capture.recorders[thread] = recorder
        return True

    def leave_recording(self) -> None:
        """This host thread stops recording into the capture it joined."""
        capture = self.capture
        recorder = None if capture is None else capture.recorders.pop(threading.get_ident(), None)
        if recorder is not None:
            self._pop(recorder)

    def abort_capture(self, graph: StandInGraph) -> None:
        """A failed capture leaves nothing behind (the recorder of this thread popped)."""
        capture = self.capture
        if capture is None or capture.graph is not graph:
            return
        recorder = capture.recorders.pop(threading.get_ident(), None)
        if recorder is not None:
            self._pop(recorder)
        self.capture = None
        graph.host, graph.groups, graph.captured = HostGraph(), [], False

    def end_capture(self, graph: StandInGraph) -> None:
        _expect(
            self.capture is not None and self.capture.graph is graph,
            "capture_end without a capture of this graph",
        )
        capture = self.capture
        recorder = capture.recorders.pop(threading.get_ident(), None)
        if recorder is not None:
            self._pop(recorder)
        _expect(not capture.recorders, "capture ended while another host thread records into it")
        _expect(not self.capture.groups, "capture ended inside an open task group")
        unjoined = self.capture.unjoined()
        _expect(
            not unjoined,
            f"capture ended with stream(s) {[s.name for s in unjoined]} not joined back to the "
            f"capture stream {self.capture.stream.name} (it must wait for their last work; "
            "torch_npu's capture_end fails: 'capture model contains a stream that was not "
            "joined to the original stream')",
        )
        self._check_stream_budget(graph)
        graph.host.compile()  # every tensor of the graph stays at its captured address
        graph.host.captured = graph.captured = True
        self.graphs.add(graph)
        self.stats["captures"] += 1
        self.capture = None

    def _check_stream_budget(self, graph: StandInGraph) -> None:
        held = sum(other.streams for other in self.graphs if other.captured and other is not graph)
        _expect(
            held + graph.streams <= self.stream_budget,
            f"capture needs {graph.streams} streams (1 + {len(graph.groups)} task groups) and "
            f"captured graphs hold {held}, over the device's budget of {self.stream_budget} "
            f"(on the NPU: error {STREAM_ERROR}, out of stream resources); capture fewer "
            "graphs (npu-graphs' max_graphs)",
        )

    def group_begin(self, stream: StandInStream) -> None:
        capture = self.capture
        _expect(capture is not None, "graph_task_group_begin outside a capture")
        _expect(
            stream in capture.clocks,
            f"graph_task_group_begin on stream {stream.name}, neither the capture stream "
            f"{capture.stream.name} nor a stream joined to the capture",
        )
        _expect(
            self.current_stream is stream,
            f"graph_task_group_begin on stream {stream.name} while the current stream is "
            f"{self.current_stream.name} (the group would hold none of the ops issued next)",
        )
        _expect(not capture.groups, "graph_task_group_begin inside an open task group")
        waited = capture.waited.pop(stream, {})
        unreset = [e for e, reset in waited.items() if not reset]
        _expect(
            not unreset,
            "an ExternalEvent waited in capture must be reset before the "
            "task group (event.wait(s); event.reset(s))",
        )
        group = TaskGroup(capture.graph, start=capture.graph.host.num_ops, events=list(waited))
        capture.groups[stream] = group

    def group_end(self, stream: StandInStream) -> TaskGroup:
        capture = self.capture
        _expect(
            capture is not None and bool(capture.groups),
            "graph_task_group_end without graph_task_group_begin",
        )
        _expect(
            stream in capture.groups,
            f"graph_task_group_end on stream {stream.name}, the group began on "
            f"{next(iter(capture.groups)).name}",
        )
        group = capture.groups.pop(stream)
        _expect(len(group.op_indices) > 0, "a task group with no torch_npu op in it")
        capture.graph.groups.append(group)
        return group

    # -- task update ------------------------------------------------------------------
    def update_begin(self, stream: StandInStream, handle: Any) -> None:
        _expect(
            isinstance(handle, TaskGroup),
            f"graph_task_update_begin needs a handle from "
            f"graph_task_group_end, got {type(handle).__name__}",
        )
        _expect(handle.graph.captured, "task update of a graph whose capture has not ended")
        _expect(self.update is None, "graph_task_update_begin inside another task update")
        _expect(
            stream is not handle.graph.capture_stream,
            "graph_task_update_begin on the capture stream: the update stream must differ "
            "from the capture stream",
        )
        _expect(
            self.capture is None or stream not in self.capture.clocks,
            "graph_task_update_begin on a stream that is capturing",
        )
        for replay in self.held_replays():
            if replay.graph is handle.graph and replay.next_op > handle.start:
                raise SchemaViolation(
                    "task update of a task group its launched replay already ran: the "
                    "group's ExternalEvent was recorded before this update (record it after "
                    "graph_task_update_end)"
                )
        guard = _UpdateGuard(self, handle, stream)
        self._push(guard)
        self.update = _Update(handle, stream, guard)

    def update_end(self, stream: StandInStream) -> None:
        update = self.update
        _expect(update is not None, "graph_task_update_end without graph_task_update_begin")
        _expect(
            stream is update.stream,
            f"graph_task_update_end on {stream.name}, the update began on {update.stream.name}",
        )
        self.update = None
        self._pop(update.guard)
        host = update.group.graph.host
        ops = host.ops
        captured = [ops[i].func.name for i in update.group.op_indices]
        issued = [call.name for call, _ in update.issued]
        _expect(
            captured == issued,
            f"a task update must re-issue the ops of its group: "
            f"captured {captured}, re-issued {issued}",
        )
        for index, (call, arguments) in zip(update.group.op_indices, update.issued):
            _check_same_tensors(call.name, ops[index].kwargs, arguments)
            ops[index] = Op(call, (), arguments, ops[index].outputs, Kind.MUTATE)
            host.program.recompile(ops, index, index + 1)
        update.group.updated_on, update.group.released = stream, False
        self.stats["task_updates"] += 1

    def record_external(self, event: StandInExternalEvent, stream: StandInStream) -> None:
        if self.capture is not None and stream in self.capture.clocks:
            raise NotModeled("ExternalEvent.record inside a capture")
        waited = stream.waits_for
        if waited is not None and not waited.done:
            _expect(
                not any(group.graph is waited.graph for group in event.groups),
                f"deadlock: stream {stream.name} waits for a replay that is held until this "
                f"ExternalEvent is recorded on {stream.name} (order the update stream after "
                "the replay before the one it updates, not after the launched one)",
            )
        for group in event.groups:
            if group.updated_on is not None and not group.released:
                _expect(
                    stream is group.updated_on,
                    f"ExternalEvent recorded on {stream.name} "
                    f"but its task group was updated on {group.updated_on.name}",
                )
                group.released = True
        event.recorded = True
        for replays in list(self.queued.values()):
            self._resume(replays)

    def replay(self, graph: StandInGraph) -> None:
        _expect(graph.captured, "replay of a graph that was not captured")
        _expect(self.capture is None, "replay during a capture")
        for group in graph.groups:
            if group.updated_on is None:
                continue
            _expect(
                bool(group.events),
                "a task group was updated but no ExternalEvent orders "
                "the replay after the update (wait + reset one before the group in capture)",
            )
            _expect(
                group.released,
                "a task group was updated but its ExternalEvent was not "
                "recorded on the update stream after graph_task_update_end",
            )
        starts = {group.start: group for group in graph.groups if group.events}
        self.stats["replays"] += 1
        replays = self.queued.setdefault(self.current_stream, [])
        replays.append(Replay(graph, self.current_stream, group_starts=starts))
        self._resume(replays)

    def _resume(self, replays: list[Replay]) -> None:
        """Run the replays queued on one stream, in order, as far as their events allow."""
        while replays:
            replay = replays[0]
            steps = replay.graph.host.program.steps
            while replay.next_op < len(steps):
                group = replay.group_starts.get(replay.next_op)
                if group is not None:
                    if not all(event.recorded for event in group.events):
                        return  # held by the captured wait
                    for event in group.events:
                        event.recorded = False  # the captured reset
                step = steps[replay.next_op]
                if step is not None:  # None: a view fixed at capture
                    step.run(_NO_SLOTS)
                    self.stats["replayed_ops"] += 1
                    if type(step.func) is CollectiveTask:
                        self.stats["replayed_collectives"] += 1
                replay.next_op += 1
            for group in replay.graph.groups:
                group.updated_on, group.released = None, False
            replay.graph.replays += 1
            replay.done = True
            replays.pop(0)


_NO_SLOTS: list = []  # a graph compiled with every tensor at its address reads no slot


def _deferred_result(name: str, arguments: dict[str, Any]) -> Any:
    """What a captured (not yet run) op hands back: its out tensors, or nothing."""
    if "out" in arguments:
        return tuple(arguments["out"])
    if name.endswith("lse_out"):  # ATB out forms name their outputs
        return arguments["output"], arguments["lse"]
    if name == "npu_scatter_pa_kv_cache":
        return None
    raise NotModeled(f"torch_npu.{name} in a capture: only out-form and in-place ops")


def _geometry(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


def _check_same_tensors(name: str, captured: dict[str, Any], issued: dict[str, Any]) -> None:
    """A task update hands each argument of ``torch_npu.<name>`` the tensors of its
    capture: the captured task reads and writes those addresses, with those shapes."""
    for argument in captured:
        before = tensor_leaves(captured[argument])
        now = tensor_leaves(issued.get(argument))
        same = len(before) == len(now) and all(
            _geometry(a) == _geometry(b) for a, b in zip(before, now)
        )
        _expect(
            same,
            f"task update of torch_npu.{name}: argument {argument!r} is "
            f"{[_describe(t) for t in now]}, the capture had {[_describe(t) for t in before]}; "
            "an update re-issues the op on the tensors of its capture (same address and "
            "shape) and changes only host arguments",
        )


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)}@{tensor.data_ptr():#x}"


# torch.distributed's collectives a capture records whole (those that exist).
DIST_COLLECTIVES = (
    "all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all_single", "broadcast",
)  # fmt: skip


@dataclass(frozen=True)
class CollectiveTask:
    """A ``torch.distributed`` collective as a recorded graph op: a replay calls it to
    completion, as a captured HCCL task completes in stream order."""

    collective: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.collective(*args, **kwargs)

    def __str__(self) -> str:
        return f"torch.distributed.{self.collective.__name__} (collective)"


def capture_collectives(runtime: NpuRuntime) -> Callable[[], None]:
    """Record the :data:`DIST_COLLECTIVES` called during a capture of ``runtime`` as one
    :class:`CollectiveTask` each (run once, unrecorded, at capture); returns what puts
    torch.distributed's own functions back."""
    saved = {name: getattr(dist, name) for name in DIST_COLLECTIVES if hasattr(dist, name)}
    for name, collective in saved.items():
        setattr(dist, name, _captured_collective(runtime, collective))

    def restore() -> None:
        for name, collective in saved.items():
            setattr(dist, name, collective)

    return restore


def _captured_collective(runtime: NpuRuntime, collective: Callable[..., Any]) -> Any:
    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        capture = runtime.capture
        if capture is None or threading.get_ident() not in capture.recorders:
            return collective(*args, **kwargs)
        host = capture.graph.host
        if host.opaque_depth:  # inside another collective, or the runtime's own work
            return collective(*args, **kwargs)
        _expect(
            not kwargs.get("async_op", False),
            f"torch.distributed.{collective.__name__}(async_op=True) in a capture: not modeled",
        )
        with runtime.unrecorded():
            result = collective(*args, **kwargs)
        host.append(Op(CollectiveTask(collective), args, kwargs, None, Kind.MUTATE))
        runtime.stats["captured_collectives"] += 1
        return result

    return call


class _DeviceRecorder(_Recorder):
    """npu-graphs' host recorder, refusing a ``c10d`` op that no captured collective
    (:func:`capture_collectives`) issued: recorded below, its work (in gloo's threads,
    and in its completion, from buffers of its own) would replay stale or not at all."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and not self._graph.opaque_depth:
            raise SchemaViolation(
                f"{func} issued in a capture outside torch.distributed's collectives "
                f"{DIST_COLLECTIVES}: the simulation captures collectives through those"
            )
        return super().__torch_dispatch__(func, types, args, kwargs)


class _UpdateGuard(TorchDispatchMode):
    """Refuses device work other than the re-issued torch_npu ops inside a task update
    on the updating host thread; views (metadata only) pass."""

    def __init__(self, runtime: NpuRuntime, group: TaskGroup, stream: StandInStream) -> None:
        super().__init__()
        self.runtime, self.group, self.stream = runtime, group, stream
        self.thread = threading.get_ident()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        update = self.runtime.update
        if (
            update is None
            or update.guard is not self
            or threading.get_ident() != self.thread
            or func in _SHAPE_QUERIES
            or (func.namespace in ("aten", "prim", "prims") and _kind_of(func) is Kind.VIEW)
        ):
            return func(*args, **kwargs)
        self.runtime.update = None  # the update is abandoned; this guard passes from now
        raise SchemaViolation(
            f"{func} issued inside a task update (graph_task_update_begin .. end on stream "
            f"{self.stream.name}): an update re-issues the group's torch_npu ops only; on the "
            "NPU this work would run eagerly, outside the graph (make inputs ready before "
            "the task, or keep them as the captured tensors)"
        )


class StandInStream:
    """``torch.npu.Stream``."""

    _runtime: NpuRuntime  # set on the runtime's bound subclass
    waits_for: Replay | None = None  # a replay this stream's later work waits for

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._runtime.check_method("Stream", "__call__", args, kwargs)
        self._runtime._streams += 1
        self.name = f"stream{self._runtime._streams}"

    @classmethod
    def internal(cls, name: str) -> StandInStream:
        """A stream the runtime makes itself (not a user call)."""
        stream = cls.__new__(cls)
        stream.name = name
        return stream

    def _check(self, method: str, args: tuple, kwargs: dict) -> dict[str, Any]:
        return self._runtime.check_method("Stream", method, args, kwargs)

    def _wait_for(self, replay: Replay | None) -> None:
        if replay is not None and not replay.done:
            self.waits_for = replay

    def _join(self, clock: dict[StandInStream, int] | None) -> None:
        """Waiting for captured work (``clock``) joins this stream to the capture."""
        capture = self._runtime.capture
        if capture is not None and clock is not None:
            capture.join(self, clock)

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        event = self._check("wait_event", args, kwargs)["event"]
        self._wait_for(getattr(event, "after", None))
        self._join(getattr(event, "clock", None))

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        other = self._check("wait_stream", args, kwargs)["stream"]
        self._wait_for(self._runtime.last_replay_on(other))
        self._join(self._runtime.captured_clock(other))

    def record_event(self, *args: Any, **kwargs: Any) -> StandInEvent:
        event = self._check("record_event", args, kwargs)["event"]
        return event if event is not None else self._runtime.classes["Event"]()

    def query(self, *args: Any, **kwargs: Any) -> bool:
        self._check("query", args, kwargs)
        return True

    def synchronize(self, *args: Any, **kwargs: Any) -> None:
        self._check("synchronize", args, kwargs)
        self._runtime.stats["synchronizes"] += 1
        _expect(self._runtime.capture is None, "Stream.synchronize during a capture")
        self._runtime.check_not_held("Stream.synchronize")

    def __repr__(self) -> str:
        return f"<stand-in torch.npu.Stream {self.name}>"


class StandInEvent:
    """``torch.npu.Event``."""

    _runtime: NpuRuntime

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._runtime.check_method("Event", "__call__", args, kwargs)
        self.after: Replay | None = None  # the last replay unfinished when recorded
        self.clock: dict[StandInStream, int] | None = None  # captured work it marks

    def record(self, *args: Any, **kwargs: Any) -> None:
        runtime = self._runtime
        stream = runtime.check_method("Event", "record", args, kwargs)["stream"]
        stream = stream if stream is not None else runtime.current_stream
        self.after = runtime.last_replay_on(stream)
        clock = runtime.captured_clock(stream)
        self.clock = dict(clock) if clock is not None else None

    def wait(self, *args: Any, **kwargs: Any) -> None:
        self._runtime.check_method("Event", "wait", args, kwargs)

    def query(self, *args: Any, **kwargs: Any) -> bool:
        self._runtime.check_method("Event", "query", args, kwargs)
        return True

    def synchronize(self, *args: Any, **kwargs: Any) -> None:
        self._runtime.check_method("Event", "synchronize", args, kwargs)
        self._runtime.stats["event_synchronizes"] += 1
        _expect(self._runtime.capture is None, "Event.synchronize during a capture")
        if self.after is not None and not self.after.done:
            self._runtime.check_not_held("Event.synchronize")


class StandInExternalEvent:
    """``torch.npu.ExternalEvent``: orders a task update before the next replay."""

    _runtime: NpuRuntime

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.groups: list[TaskGroup] = []
        self.recorded = False  # recorded since the last captured reset consumed it
        self._runtime.check_method("ExternalEvent", "__call__", args, kwargs)

    def _stream(self, method: str, args: tuple, kwargs: dict) -> StandInStream:
        stream = self._runtime.check_method("ExternalEvent", method, args, kwargs)["stream"]
        return stream if stream is not None else self._runtime.current_stream

    def wait(self, *args: Any, **kwargs: Any) -> None:
        stream = self._stream("wait", args, kwargs)
        capture = self._runtime.capture
        if capture is not None and stream in capture.clocks:
            capture.waited.setdefault(stream, {})[self] = False

    def reset(self, *args: Any, **kwargs: Any) -> None:
        stream = self._stream("reset", args, kwargs)
        capture = self._runtime.capture
        if capture is not None and stream in capture.clocks:
            waited = capture.waited.get(stream, {})
            _expect(self in waited, "ExternalEvent.reset in capture before its wait")
            waited[self] = True

    def record(self, *args: Any, **kwargs: Any) -> None:
        self._runtime.record_external(self, self._stream("record", args, kwargs))


class StandInGraph:
    """``torch.npu.NPUGraph``: recorded torch_npu ops, replayed on CPU."""

    _runtime: NpuRuntime

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._runtime.check_method("NPUGraph", "__call__", args, kwargs)
        self.host = HostGraph()  # the recording: aten ops and whole torch_npu ops
        self.groups: list[TaskGroup] = []
        self.captured = False
        self.capture_stream: StandInStream | None = None
        self.replays = 0

    def capture_begin(self, *args: Any, **kwargs: Any) -> None:
        arguments = self._runtime.check_method("NPUGraph", "capture_begin", args, kwargs)
        runtime = self._runtime
        runtime.begin_capture(self, runtime.current_stream, arguments["capture_error_mode"])

    def capture_end(self, *args: Any, **kwargs: Any) -> None:
        self._runtime.check_method("NPUGraph", "capture_end", args, kwargs)
        try:
            self._runtime.end_capture(self)
        except BaseException:
            self._runtime.abort_capture(self)
            raise

    @property
    def streams(self) -> int:
        """Streams this graph holds on the device: its own, and one per task group."""
        return 1 + len(self.groups)

    def replay(self, *args: Any, **kwargs: Any) -> None:
        self._runtime.check_method("NPUGraph", "replay", args, kwargs)
        self._runtime.replay(self)

    def reset(self, *args: Any, **kwargs: Any) -> None:
        self._runtime.check_method("NPUGraph", "reset", args, kwargs)
        self.host, self.groups, self.captured = HostGraph(), [], False

    def pool(self, *args: Any, **kwargs: Any) -> object:
        self._runtime.check_method("NPUGraph", "pool", args, kwargs)
        return ("pool", id(self))

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._runtime.check_method("NPUGraph", "update", args, kwargs)
        raise NotModeled("NPUGraph.update (auto_dispatch_capture)")


class StandInNpuNamespace(types.ModuleType):
    """``torch.npu`` / ``torch_npu.npu`` as the stand-in runtime answers it."""

    def __init__(self, runtime: NpuRuntime) -> None:
        super().__init__("torch.npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None)
        self.runtime = runtime
        for name, cls in runtime.classes.items():
            setattr(self, name, cls)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self.runtime.api.exported:
            raise NotModeledAttribute(f"torch.npu.{name}")
        raise UnknownAttribute(f"torch.npu has no attribute {name!r} in torch_npu's Python API")

    # -- functions --------------------------------------------------------------------
    def current_stream(self, *args: Any, **kwargs: Any) -> StandInStream:
        self.runtime.check_function("current_stream", args, kwargs)
        return self.runtime.current_stream

    def default_stream(self, *args: Any, **kwargs: Any) -> StandInStream:
        self.runtime.check_function("default_stream", args, kwargs)
        return self.runtime.default_stream

    @contextlib.contextmanager
    def stream(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        stream = self.runtime.check_function("stream", args, kwargs)["stream"]
        if stream is None:
            yield
            return
        previous, self.runtime.current_stream = self.runtime.current_stream, stream
        try:
            yield
        finally:
            self.runtime.current_stream = previous

    def set_stream(self, *args: Any, **kwargs: Any) -> None:
        stream = self.runtime.check_function("set_stream", args, kwargs)["stream"]
        if stream is not None:
            self.runtime.current_stream = stream

    def synchronize(self, *args: Any, **kwargs: Any) -> None:
        self.runtime.check_function("synchronize", args, kwargs)
        self.runtime.stats["synchronizes"] += 1
        _expect(self.runtime.capture is None, "torch.npu.synchronize during a capture")
        self.runtime.check_not_held("torch.npu.synchronize")

    def graph_pool_handle(self, *args: Any, **kwargs: Any) -> object:
        self.runtime.check_function("graph_pool_handle", args, kwargs)
        return ("pool", object())

    def is_current_stream_capturing(self, *args: Any, **kwargs: Any) -> bool:
        self.runtime.check_function("is_current_stream_capturing", args, kwargs)
        capture = self.runtime.capture
        return capture is not None and self.runtime.current_stream in capture.clocks

    def graph_task_group_begin(self, *args: Any, **kwargs: Any) -> None:
        stream = self.runtime.check_function("graph_task_group_begin", args, kwargs)["stream"]
        self.runtime.group_begin(stream)

    def graph_task_group_end(self, *args: Any, **kwargs: Any) -> TaskGroup:
        stream = self.runtime.check_function("graph_task_group_end", args, kwargs)["stream"]
        group = self.runtime.group_end(stream)
        for event in group.events:
            event.groups.append(group)
        return group

    def graph_task_update_begin(self, *args: Any, **kwargs: Any) -> None:
        arguments = self.runtime.check_function("graph_task_update_begin", args, kwargs)
        self.runtime.update_begin(arguments["stream"], arguments["handle"])

    def graph_task_update_end(self, *args: Any, **kwargs: Any) -> None:
        stream = self.runtime.check_function("graph_task_update_end", args, kwargs)["stream"]
        self.runtime.update_end(stream)

    def is_available(self, *args: Any, **kwargs: Any) -> bool:
        self.runtime.check_function("is_available", args, kwargs)
        return True

    def device_count(self, *args: Any, **kwargs: Any) -> int:
        self.runtime.check_function("device_count", args, kwargs)
        return 1

    def current_device(self, *args: Any, **kwargs: Any) -> int:
        self.runtime.check_function("current_device", args, kwargs)
        return 0

    def memory_allocated(self, *args: Any, **kwargs: Any) -> int:
        self.runtime.check_function("memory_allocated", args, kwargs)
        return 0

    def mem_get_info(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        self.runtime.check_function("mem_get_info", args, kwargs)
        return 48 << 30, 64 << 30  # free, total

    def empty_cache(self, *args: Any, **kwargs: Any) -> None:
        self.runtime.check_function("empty_cache", args, kwargs)


def _bound_classes(runtime: NpuRuntime) -> dict[str, type]:
    """The ``torch.npu`` classes, bound to ``runtime`` (one set per stand-in)."""
    classes = {
        name: type(name, (base,), {"_runtime": runtime})
        for name, base in (
            ("Stream", StandInStream),
            ("Event", StandInEvent),
            ("ExternalEvent", StandInExternalEvent),
            ("NPUGraph", StandInGraph),
        )
    }
    classes["graph"] = _graph_context_class(runtime)
    classes["device"] = _device_context_class(runtime)
    return classes


def _with_self(signature: inspect.Signature) -> inspect.Signature:
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return signature.replace(parameters=[self_parameter, *signature.parameters.values()])


def _graph_context_class(runtime: NpuRuntime) -> type:
    """``torch.npu.graph``: a class whose ``__init__`` has torch_npu's signature."""

    class graph:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._arguments = runtime.check_method("graph", "__call__", args, kwargs)
            self._previous: StandInStream | None = None

        def __enter__(self) -> None:
            arguments = self._arguments
            if arguments["auto_dispatch_capture"]:
                raise NotModeled("torch.npu.graph(auto_dispatch_capture=True)")
            stream = arguments["stream"]
            if stream is None:
                if runtime.side_stream is None:
                    runtime.side_stream = runtime.new_stream()
                stream = runtime.side_stream
            graph = arguments["npu_graph"]
            _expect(isinstance(graph, StandInGraph), "torch.npu.graph needs a torch.npu.NPUGraph")
            self._previous, runtime.current_stream = runtime.current_stream, stream
            try:
                runtime.begin_capture(graph, stream, arguments["capture_error_mode"])
            except BaseException:
                runtime.current_stream = self._previous
                raise

        def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
            graph = self._arguments["npu_graph"]
            try:
                if exc_type is None:
                    runtime.end_capture(graph)
            except BaseException:
                runtime.abort_capture(graph)  # a failed capture leaves nothing behind
                raise
            finally:
                runtime.current_stream = self._previous
                runtime.abort_capture(graph)  # on an exception inside the block

    graph.__init__.__signature__ = _with_self(runtime.api.method("graph", "__call__"))
    return graph


def _device_context_class(runtime: NpuRuntime) -> type:
    """``torch.npu.device``: selects the (only) device; a no-op here."""

    class device:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            runtime.check_method("device", "__call__", args, kwargs)
            self._joined = False

        def __enter__(self) -> None:
            # A host thread joining a capture (npu-graphs' join_capture) records into it.
            self._joined = runtime.join_recording()

        def __exit__(self, *args: Any) -> None:
            if self._joined:
                runtime.leave_recording()

    return device


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise SchemaViolation(message)
