"""Host graphs: CPU tensor work recorded as a list of aten ops, mirroring NPU graphs.

Capture runs the work once and records every aten op issued inside the capture
context (through a ``TorchDispatchMode``) together with its arguments and outputs.
Replay re-executes the recorded ops in order and writes their results into the
tensors produced at capture, so a graph's outputs live at fixed addresses, as on a
device. Host arguments (Python ints, lists) are baked into the records exactly as an
NPU graph bakes them into its tasks: a slice length captured as 4 stays 4 at replay.

A task group brackets the ops of one updatable task. ``update_tasks`` re-issues the
task's callable with new host arguments under an update recorder that executes
nothing (as an NPU task update executes nothing): it only checks that the same number
and kind of ops come out and swaps their arguments into the group.

Ops outside the ``aten``/``prims`` namespaces (custom ops whose Python kernel may read
global state at call time) are recorded *below*: their kernel runs with the recorder
active, so the aten ops they issue are recorded with the values read at capture.
Replaying them as one opaque op would re-read fresh state and hide staleness. Custom
ops known to read nothing but their arguments (C++ kernels such as a GEMM library's,
whose work a recording below could not see) are registered with
:meth:`HostGraphBackend.record_whole` and recorded as one op like an aten op.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from npu_graphs.backends.base import GraphBackend, TaskUpdate
from npu_graphs.backends.host_program import (
    HostProgram,
    Kind,
    Layout,
    Op,
    substitute,
    tensor_leaves,
)
from npu_graphs.errors import GraphCaptureError, GraphReplayError, TaskUpdateError

_NATIVE_NAMESPACES = frozenset({"aten", "prim", "prims"})
# Custom ops that read nothing but their arguments: recorded as one op each.
_WHOLE_OPS: set[Any] = set()
_aten = torch.ops.aten
_ALLOC_OPS = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_like.default,
        _aten.empty_strided.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
    }
)
_METADATA_OPS = frozenset({"set_", "resize_", "resize_as_"})
# Shape queries (what a traced graph with symbolic sizes calls): their host results
# come from shapes, which are fixed per captured graph, so they are baked like any
# shape and never redone.
_SHAPE_QUERIES = frozenset(
    {
        _aten.sym_size.int,
        _aten.sym_stride.int,
        _aten.sym_numel.default,
        _aten.sym_storage_offset.default,
    }
)


_KINDS: dict[Any, Kind] = {}


def _kind_of(func: torch._ops.OpOverload) -> Kind:
    kind = _KINDS.get(func)
    if kind is None:
        if func in _ALLOC_OPS:
            kind = Kind.ALLOC
        elif (
            func.is_view
            or torch.Tag.inplace_view in func.tags
            or func._schema.name.split("::")[-1] in _METADATA_OPS
        ):
            kind = Kind.VIEW
        elif func._schema.is_mutable:
            kind = Kind.MUTATE
        else:
            kind = Kind.COMPUTE
        _KINDS[func] = kind
    return kind


def _check_no_host_values(func: Any, outputs: Any) -> None:
    for leaf in tree_leaves(outputs):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            raise GraphCaptureError(
                f"{func} returned a host value ({type(leaf).__name__}) during capture; a device "
                "graph cannot feed tensor values back to the host (as .item(), .tolist() or "
                "a tensor-valued condition would): compute it before the capture"
            )


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _aliases_inputs(outputs: Any, args: tuple, kwargs: dict) -> bool:
    """True if every tensor output shares storage with some tensor input."""
    inputs = {leaf.untyped_storage().data_ptr() for leaf in tensor_leaves((args, kwargs))}
    return all(leaf.untyped_storage().data_ptr() in inputs for leaf in tensor_leaves(outputs))


def _backend_keys(args: tuple, kwargs: dict) -> Any:
    below_python = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
    for leaf in tensor_leaves((args, kwargs)):
        return torch._C._dispatch_keys(leaf) & below_python
    return None


class HostGraph:
    """A recorded stream of aten ops on CPU tensors; see the module docstring."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.groups: list[tuple[int, int]] = []
        self.captured = False
        self.program: HostProgram | None = None
        self._opaque = threading.local()  # depth > 0 while a task recorded whole runs
        self._lock = threading.Lock()

    def append(self, op: Op) -> None:
        with self._lock:
            self.ops.append(op)

    def reset(self) -> None:
        """Drop everything recorded; the graph can be captured again."""
        self.ops, self.groups, self.captured, self.program = [], [], False, None

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def compile(
        self,
        outputs: Any = None,
        *,
        outputs_known: bool = False,
        inputs: Sequence[torch.Tensor] = (),
    ) -> None:
        """Compile the recording for replay.

        Until the outputs are known every tensor the graph allocated is kept at its
        captured address (a raw capture may hand out any of them); once they are, a
        replay takes every intermediate from the allocator for its live range only and
        returns fresh outputs (see ``host_program``).
        """
        layout = Layout.of(self.ops, outputs_known)
        self.program = HostProgram(
            self.ops, layout, keep=self.groups, outputs=outputs, inputs=inputs
        )

    def nbytes(self) -> int:
        """Bytes this graph keeps between replays (outputs; tensors kept for task updates)."""
        if self.program is None:
            return 0
        storages = {}
        for op in self.ops:
            for leaf in tensor_leaves(op.outputs):
                storage = leaf.untyped_storage()
                if storage.data_ptr() in self.program.layout.persistent:
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values()) + self.program.kept_bytes()

    @property
    def peak_transient_bytes(self) -> int:
        """Bytes of intermediates live at once at the peak of a replay (from the pool)."""
        return self.program.peak_transient_bytes if self.program is not None else 0

    def replay(self, inputs: Sequence[torch.Tensor] | None = None) -> Any:
        """Run the recorded ops on ``inputs`` (the graph's input tensors, when
        ``finish_capture`` named them); returns the outputs (``None`` before)."""
        if not self.captured or self.program is None:
            raise GraphReplayError("this host graph has not been captured (or its capture failed)")
        return self.program.run(inputs)

    def stage_update(self, index: int, issue: Callable[[], object] | None) -> _GroupUpdate:
        """Re-issue task group ``index`` through ``issue``; ``commit()`` the result to apply it."""
        start, end = self.groups[index]
        if self.ops[start].kind is Kind.TASK:
            return _TaskUpdate(self, index, start, issue)
        update = _GroupUpdate(self, index, start, end)
        with _Recorder(self, update):
            issue()
        update.check_complete()
        return update

    @property
    def opaque_depth(self) -> int:
        """Tasks recorded whole that this thread is running inside (their ops pass unrecorded)."""
        return getattr(self._opaque, "depth", 0)

    def record_task(self, fn: Callable[..., Any], args: tuple, kwargs: dict, host: dict) -> Any:
        """Run ``fn`` and record it as one op whose host arguments ``host`` are baked."""
        self._opaque.depth = self.opaque_depth + 1
        try:
            result = fn(*args, **kwargs, **host)
        finally:
            self._opaque.depth -= 1
        start = self.num_ops
        self.append(Op(fn, args, dict(kwargs), result, Kind.TASK, dict(host)))
        self.groups.append((start, start + 1))
        return result


class _TaskUpdate:
    """Stages new host arguments for a task recorded whole (an update executes nothing)."""

    def __init__(self, graph: HostGraph, index: int, position: int, issue: Any) -> None:
        self.graph, self.position = graph, position
        self.host = getattr(issue, "host_values", None)
        captured = graph.ops[position].host
        if self.host is None or set(self.host) != set(captured):
            got = "no host_values" if self.host is None else sorted(self.host)
            raise TaskUpdateError(
                f"task group {index}: the update must give the host arguments "
                f"{sorted(captured)} (as TaskIssue.host_values), got {got}"
            )

    def commit(self) -> None:
        self.graph.ops[self.position].host = dict(self.host)
        if self.graph.program is not None:
            self.graph.program.set_task_host(self.graph.ops, self.position)


class _GroupUpdate:
    """Stages the records of one task-group update; commits only if it matches the capture."""

    def __init__(self, graph: HostGraph, index: int, start: int, end: int) -> None:
        self.graph, self.index, self.start, self.end = graph, index, start, end
        self.staged: list[Op] = []
        self.aliases: dict[int, Any] = {}  # id(fresh view handed out) -> captured view
        self._fresh_views: list[Any] = []  # keeps the ids in ``aliases`` unique

    def issue(self, func: Any, args: tuple, kwargs: dict) -> Any:
        position = len(self.staged)
        if self.start + position >= self.end:
            raise TaskUpdateError(
                f"task group {self.index}: the update issued more ops than the "
                f"{self.end - self.start} captured (extra op: {func})"
            )
        old = self.graph.ops[self.start + position]
        if old.func is not func:
            raise TaskUpdateError(
                f"task group {self.index}, op {position}: captured {old.func}, "
                f"the update issued {func}; an update must issue the same ops"
            )
        if self.aliases:
            args, kwargs = substitute(args, self.aliases), substitute(kwargs, self.aliases)
        if old.kind is not Kind.VIEW and old.kind is not Kind.REFRESH:
            self._check_input_shapes(old, func, args, kwargs)
            self.staged.append(Op(func, args, kwargs, old.outputs, old.kind))
            return old.outputs
        # A view: metadata only, nothing is computed. The fresh view is handed on (autograd
        # cannot re-wrap the captured one) and aliases the same memory when unchanged.
        fresh = func(*args, **kwargs)
        self.staged.append(self._restage_view(old, func, args, kwargs, fresh))
        for captured, new in zip(tree_leaves(old.outputs), tree_leaves(fresh)):
            if isinstance(new, torch.Tensor):
                self.aliases[id(new)] = captured
        self._fresh_views.append(fresh)
        return fresh

    def _check_input_shapes(self, old: Op, func: Any, args: tuple, kwargs: dict) -> None:
        before = [tuple(t.shape) for t in tensor_leaves((old.args, old.kwargs))]
        now = [tuple(t.shape) for t in tensor_leaves((args, kwargs))]
        if before != now:
            raise TaskUpdateError(
                f"task group {self.index}: {func} input shapes {now} differ from the "
                f"captured {before}; shapes are fixed per graph"
            )

    def _restage_view(self, old: Op, func: Any, args: tuple, kwargs: dict, fresh: Any) -> Op:
        pairs = list(zip(tree_leaves(old.outputs), tree_leaves(fresh)))
        if all(_same_geometry(a, b) for a, b in pairs):
            return Op(func, args, kwargs, old.outputs, Kind.VIEW)
        for captured, new in pairs:
            if captured.shape != new.shape or captured.dtype != new.dtype:
                raise TaskUpdateError(
                    f"task group {self.index}: {func} now gives shape {tuple(new.shape)} "
                    f"where the capture gave {tuple(captured.shape)}; shapes are fixed per graph"
                )
            if captured.untyped_storage().data_ptr() == new.untyped_storage().data_ptr():
                raise TaskUpdateError(
                    f"task group {self.index}: {func} now views its base differently; pass "
                    "step state to the op as host arguments, not as views of graph tensors"
                )
        return Op(func, args, kwargs, old.outputs, Kind.REFRESH)

    def check_complete(self) -> None:
        if self.start + len(self.staged) != self.end:
            raise TaskUpdateError(
                f"task group {self.index}: the update issued {len(self.staged)} ops, "
                f"the capture recorded {self.end - self.start}"
            )

    def commit(self) -> None:
        self.graph.ops[self.start : self.end] = self.staged
        if self.graph.program is not None:
            self.graph.program.recompile(self.graph.ops, self.start, self.end)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: HostGraph, update: _GroupUpdate | None = None) -> None:
        super().__init__()
        self._graph = graph
        self._update = update

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._graph.opaque_depth:
            return func(*args, **kwargs)
        if func.namespace not in _NATIVE_NAMESPACES and func not in _WHOLE_OPS:
            return self._record_below(func, args, kwargs)
        if self._update is not None:
            return self._update.issue(func, args, kwargs)
        outputs = func(*args, **kwargs)
        if func in _SHAPE_QUERIES:
            self._graph.append(Op(func, args, kwargs, outputs, Kind.VIEW))
            return outputs
        _check_no_host_values(func, outputs)
        kind = _kind_of(func)
        if kind is Kind.VIEW and not _aliases_inputs(outputs, args, kwargs):
            # Composite ops such as aten.to / aten.reshape carry alias annotations but
            # copy when they must (a dtype change, a non-viewable shape): redo those.
            kind = Kind.COMPUTE
        self._graph.append(Op(func, args, kwargs, outputs, kind))
        return outputs

    def _record_below(self, func: Any, args: tuple, kwargs: dict) -> Any:
        keys = _backend_keys(args, kwargs)
        if keys is None:
            raise GraphCaptureError(f"{func} takes no tensor; the host graph cannot record it")
        with self:
            return func.redispatch(keys, *args, **kwargs)


_ACTIVE_LOCK = threading.Lock()
_ACTIVE: HostGraph | None = None


class HostStream:
    """A stream stand-in: host graphs run in issue order, so ordering calls do nothing."""

    def wait_event(self, event: HostEvent) -> None:
        pass

    def wait_stream(self, stream: HostStream) -> None:
        pass

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        return event if event is not None else HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostEvent:
    """An event stand-in that counts its records (work is done when it is issued)."""

    def __init__(self) -> None:
        self.records = 0

    def record(self, stream: HostStream | None = None) -> None:
        self.records += 1

    def wait(self, stream: HostStream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@dataclass(frozen=True)
class HostTaskHandle:
    """Identifies one task group of one host graph."""

    graph: HostGraph
    index: int


class HostGraphBackend(GraphBackend):
    """Graphs of CPU tensor work; lets CI test everything built on graphs without a device."""

    name = "host"
    device_type = "cpu"
    supports_task_update = True
    weak_ref_outputs = False  # CPU memory has no graph pool to hand out views of
    capture_executes = True
    records_tasks_whole = True
    replay_returns_outputs = True
    replay_takes_inputs = True

    def __init__(self) -> None:
        self._graphs: weakref.WeakSet[HostGraph] = weakref.WeakSet()
        self._stream = HostStream()

    def new_graph(self) -> HostGraph:
        graph = HostGraph()
        self._graphs.add(graph)
        return graph

    def new_pool(self) -> object:
        return object()

    @contextlib.contextmanager
    def capture(self, graph: Any, *, pool: Any = None, stream: Any = None) -> Iterator[None]:
        global _ACTIVE
        if not isinstance(graph, HostGraph):
            raise TypeError(f"expected a HostGraph, got {type(graph).__name__}")
        if graph.captured:
            raise GraphCaptureError("this host graph is already captured; reset() it first")
        with _ACTIVE_LOCK:
            if _ACTIVE is not None:
                raise GraphCaptureError("another host graph capture is under way")
            _ACTIVE = graph
        try:
            with _Recorder(graph):
                yield
            graph.compile()
        except BaseException:
            graph.reset()
            raise
        else:
            graph.captured = True
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE = None

    @staticmethod
    def record_whole(*ops: Any) -> None:
        """Record these custom ops (``OpOverload``s) as one op each, not below.

        Only for ops whose kernels read nothing but their arguments: a replay re-runs
        them with the captured arguments, so state they read elsewhere would be fresh.
        """
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"record_whole takes OpOverloads, got {type(op).__name__}")
            _WHOLE_OPS.add(op)

    def finish_capture(self, graph: Any, outputs: Any, inputs: Sequence[torch.Tensor] = ()) -> None:
        """Release what the capture allocated: from now on each replay computes its
        intermediates and outputs afresh (only tensors task updates need are kept), and
        reads the tensors it is given in place of ``inputs``, the captured ones (so a
        graph fed by another graph's fresh outputs reads this step's)."""
        graph.compile(outputs, outputs_known=True, inputs=inputs)

    def replay(self, graph: Any, inputs: Sequence[torch.Tensor] | None = None) -> Any:
        return graph.replay(inputs)

    def is_capturing(self) -> bool:
        return _ACTIVE is not None

    @staticmethod
    @contextlib.contextmanager
    def unrecorded() -> Iterator[None]:
        """The ops this thread issues in the block run now and stay out of the capture
        under way (none: the block just runs): host-side bookkeeping whose results no
        replay needs, such as a check that reads a tensor's value."""
        graph = _ACTIVE
        if graph is None:
            yield
            return
        graph._opaque.depth = graph.opaque_depth + 1
        try:
            yield
        finally:
            graph._opaque.depth -= 1

    @contextlib.contextmanager
    def join_capture(self) -> Iterator[None]:
        graph = _ACTIVE
        if graph is None:
            yield
            return
        with _Recorder(graph):
            yield

    def new_stream(self) -> HostStream:
        return HostStream()

    def current_stream(self) -> HostStream:
        return self._stream

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(stream)

    def new_event(self) -> HostEvent:
        return HostEvent()

    def synchronize(self) -> None:
        pass

    def task_group_begin(self, graph: Any, stream: Any) -> int:
        if graph is not _ACTIVE:
            raise GraphCaptureError("task_group_begin outside the capture of this graph")
        return graph.num_ops

    def task_group_end(self, graph: Any, stream: Any, token: Any) -> HostTaskHandle:
        if graph is not _ACTIVE:
            raise GraphCaptureError("task_group_end outside the capture of this graph")
        graph.groups.append((token, graph.num_ops))
        return HostTaskHandle(graph, len(graph.groups) - 1)

    def record_task(
        self,
        graph: Any,
        stream: Any,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        host_values: Mapping[str, Any],
    ) -> tuple[Any, HostTaskHandle]:
        """Run ``fn(*args, **kwargs, **host_values)`` as one recorded op (an opaque task).

        Like an NPU kernel whose host arguments are baked into its task, the op replays
        with ``host_values`` as captured until ``update_tasks`` swaps in new ones; the
        ops ``fn`` issues are not recorded one by one, so it may pick shapes from its
        host arguments (a kernel that sizes its tiles by the step's sequence lengths).
        """
        if graph is not _ACTIVE:
            raise GraphCaptureError("record_task outside the capture of this graph")
        result = graph.record_task(fn, args, kwargs, dict(host_values))
        return result, HostTaskHandle(graph, len(graph.groups) - 1)

    def update_tasks(self, graph: Any, updates: Sequence[TaskUpdate]) -> None:
        if _ACTIVE is not None:
            raise GraphCaptureError("task update while a capture is under way")
        staged = [graph.stage_update(h.index, issue) for h, issue in updates if issue is not None]
        for update in staged:  # all or nothing
            update.commit()

    def memory_in_use(self) -> int:
        """What the graphs hold (their own bytes) plus the pool their replays draw on."""
        own, pool = self.memory_breakdown()
        return own + pool

    def memory_breakdown(self) -> tuple[int, int]:
        """``(own, pool)``: bytes graphs keep between replays, and the largest replay peak
        of intermediates (one pool: replays run one at a time and release as they go)."""
        graphs = [graph for graph in list(self._graphs) if graph.captured]
        own = sum(graph.nbytes() for graph in graphs)
        pool = max((graph.peak_transient_bytes for graph in graphs), default=0)
        return own, pool
