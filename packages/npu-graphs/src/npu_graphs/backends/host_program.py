"""A host graph's recorded ops compiled for replay, with liveness-based memory.

A device graph owns a pool: its intermediates live at fixed addresses inside it, and
graphs captured into one pool (largest first) reuse that memory. A host graph needs
no fixed addresses for its intermediates, since nothing bakes them: a replay takes
each intermediate from the process allocator and drops it after its last reader
(liveness over the recorded op list), so storage whose lifetimes do not overlap is
reused, and every graph draws on one pool, the host heap, of which at most one
replay's intermediates are live at a time.

A graph's outputs are replay-local too: each replay hands out the tensors it computed
(a device graph hands out the same addresses each time; a caller that consumes its
outputs before the next replay, as the device contract requires, sees no difference).
So a compiled graph keeps nothing between replays but tensors that task updates
re-issue against. Storage produced outside the graph (inputs, weights, caches and
tensors baked into the recording) belongs to the caller. A recording compiled before
its outputs are known keeps every tensor it produced, at the captured addresses.

Storage is classified once, when the graph's outputs are known
(:meth:`HostProgram.compile`):

* *external*: first seen as an op input: used by reference, never copied;
* *persistent* (only until the outputs are known): produced inside the graph; each
  replay recomputes it and copies the result into the captured tensor;
* *transient*: every other storage produced inside the graph: each tensor on it is a
  slot of the replay's environment, filled by its producer and emptied after its
  last reader.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from npu_graphs.errors import GraphReplayError


class Kind(enum.Enum):
    VIEW = "view"  # output aliases an input with fixed geometry
    ALLOC = "alloc"  # uninitialized allocation
    MUTATE = "mutate"  # writes into its arguments
    COMPUTE = "compute"  # fresh outputs
    REFRESH = "refresh"  # a view whose arguments an update changed: redo
    TASK = "task"  # an updatable task recorded whole, its host arguments baked


@dataclass
class Op:
    """One recorded op: ``func(*args, **kwargs, **host)`` gave ``outputs`` at capture."""

    func: Any
    args: tuple
    kwargs: dict
    outputs: Any
    kind: Kind
    host: dict = field(default_factory=dict)  # TASK only: the baked host arguments


@dataclass(frozen=True)
class Slot:
    """Where a transient tensor lives in a replay's environment."""

    index: int


def storage_key(tensor: torch.Tensor) -> Any:
    """Identifies a tensor's storage among the storages alive at capture."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:  # empty storages may share an address
        return ("empty", id(tensor))
    return storage.data_ptr()


# Leaves of the types aten ops take besides tensors and containers of them.
_PLAIN_LEAVES = frozenset(
    {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout}
    | {torch.memory_format}
)


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors among ``value``'s pytree leaves, in pytree order.

    Plain tuples, lists and dicts (what aten ops take and return) are walked here, a
    few times faster than ``tree_leaves``; any other pytree node (named tuples,
    ``torch.return_types``, registered classes) goes through ``tree_leaves``.
    """
    found: list[torch.Tensor] = []
    _collect_tensors(value, found)
    return found


def _collect_tensors(value: Any, found: list[torch.Tensor]) -> None:
    kind = type(value)
    if kind is tuple or kind is list or kind is dict:
        for item in value.values() if kind is dict else value:
            if type(item) not in _PLAIN_LEAVES:  # sizes and flags: no call per number
                _collect_tensors(item, found)
    elif isinstance(value, torch.Tensor):
        found.append(value)
    elif kind not in _PLAIN_LEAVES:
        found.extend(leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))


@dataclass(frozen=True)
class Layout:
    """Where each storage of a recording lives (see the module docstring)."""

    persistent: frozenset
    transient: dict  # storage key -> nbytes

    @staticmethod
    def of(ops: Sequence[Op], outputs_known: bool) -> Layout:
        """Classify the storages of ``ops``; until the outputs are known every storage
        produced inside the graph persists."""
        seen: set = set()
        internal: dict = {}
        for op in ops:
            for leaf in tensor_leaves((op.args, op.kwargs)):
                seen.add(storage_key(leaf))
            for leaf in tensor_leaves(op.outputs):
                key = storage_key(leaf)
                if key not in seen and op.kind is not Kind.VIEW:
                    internal[key] = leaf.untyped_storage().nbytes()
                seen.add(key)
        if not outputs_known:
            return Layout(frozenset(internal), {})
        return Layout(frozenset(), internal)


class _Nested:
    """A list or tuple argument holding slots, rebuilt at each replay."""

    __slots__ = ("items", "kind")

    def __init__(self, kind: type, items: list) -> None:
        self.kind, self.items = kind, items

    def resolve(self, env: list) -> Any:
        return self.kind(_resolve(item, env) for item in self.items)


def _resolve(value: Any, env: list) -> Any:
    kind = type(value)
    if kind is Slot:
        return env[value.index]
    if kind is _Nested:
        return value.resolve(env)
    return value


class _Step:
    """One op of the compiled replay."""

    __slots__ = (
        "args",
        "bind",
        "copy",
        "func",
        "kwargs",
        "release",
        "single_output",
        "slotted_args",
        "slotted_kwargs",
    )

    def __init__(self, func: Callable, args: tuple, kwargs: dict) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.slotted_args = any(type(a) in (Slot, _Nested) for a in args)
        self.slotted_kwargs = any(type(v) in (Slot, _Nested) for v in kwargs.values())
        self.single_output = True
        self.bind: list[tuple[int, int]] = []  # (output leaf, slot)
        self.copy: list[tuple[int, torch.Tensor]] = []  # (output leaf, captured tensor)
        self.release: tuple[int, ...] = ()

    def run(self, env: list) -> None:
        args = tuple(_resolve(a, env) for a in self.args) if self.slotted_args else self.args
        kwargs = self.kwargs
        if self.slotted_kwargs:
            kwargs = {k: _resolve(v, env) for k, v in kwargs.items()}
        result = self.func(*args, **kwargs)
        if self.bind or self.copy:
            leaves = (result,) if self.single_output else tensor_leaves(result)
            for leaf, slot in self.bind:
                env[slot] = leaves[leaf]
            for leaf, captured in self.copy:
                fresh = leaves[leaf]
                if fresh is not captured:
                    captured.copy_(fresh)
        for slot in self.release:
            env[slot] = None


class HostProgram:
    """The replay of a recorded op list under a :class:`Layout`.

    Args:
        ops: the recording (ops inside task groups keep their capture-time tensors,
            which an update re-issues against; the others are rewritten with slots).
        layout: the storage classification.
        keep: op index ranges whose records must keep their capture-time tensors.
        outputs: what the capture returned; a replay returns the same structure with
            this replay's tensors (``None``: nothing is returned).
        inputs: the tensors the capture was called with; a replay reads the tensors
            passed to :meth:`run` in their place (and views of them, recorded, in place
            of the captured views).
    """

    def __init__(
        self,
        ops: list[Op],
        layout: Layout,
        keep: Iterable[tuple[int, int]] = (),
        outputs: Any = None,
        inputs: Sequence[torch.Tensor] = (),
    ) -> None:
        self.layout = layout
        self._slots: dict[int, int] = {}  # id(capture-time tensor) -> slot
        self._frozen = False
        # Capture-time tensors read from the replay's environment though their storage
        # is external: the inputs and the recorded views of them.
        self._bound: set[int] = {id(t) for t in inputs}
        self._inputs = [(self._slot_of(t), t.shape, t.dtype) for t in inputs]
        self.steps: list[_Step | None] = [self._compile(op) for op in ops]
        self._outputs = _OutputTemplate(outputs, self._template)
        self.num_slots = len(self._slots)
        self._set_releases()
        self.peak_transient_bytes = self._peak_bytes(ops)
        self._env: list = [None] * self.num_slots
        # A task recorded whole is updated by its host arguments alone (set_task_host).
        kept_ops = {
            i for start, end in keep for i in range(start, end) if ops[i].kind is not Kind.TASK
        }
        # Tensors that kept records still reference: their ids stay valid slot keys.
        self._kept = [t for i in kept_ops for t in tensor_leaves(_record_values(ops[i]))]
        self._forget_transients(ops, kept_ops)
        kept_ids = {id(t) for t in self._kept}
        self._slots = {i: s for i, s in self._slots.items() if i in kept_ids}
        self._bound &= kept_ids
        self._frozen = True

    # -- compile ----------------------------------------------------------------------
    def _is_transient(self, tensor: torch.Tensor) -> bool:
        return storage_key(tensor) in self.layout.transient

    def _in_env(self, tensor: torch.Tensor) -> bool:
        """Read from the replay's environment: transient, an input or a view of one."""
        return id(tensor) in self._bound or self._is_transient(tensor)

    def _slot_of(self, tensor: torch.Tensor) -> int:
        slot = self._slots.get(id(tensor))
        if slot is None:
            if self._frozen:
                raise AssertionError("a task update introduced a tensor the capture did not have")
            slot = self._slots[id(tensor)] = len(self._slots)
        return slot

    def _template(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return Slot(self._slot_of(value)) if self._in_env(value) else value
        if type(value) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            items = [self._template(v) for v in value]
            if any(type(v) in (Slot, _Nested) for v in items):
                return _Nested(type(value), items)
        return value

    def _compile(self, op: Op) -> _Step | None:
        inputs = tensor_leaves((op.args, op.kwargs))
        reads_env = any(self._in_env(t) for t in inputs)
        outputs = tensor_leaves(op.outputs)
        if op.kind is Kind.VIEW and (not reads_env or not outputs):
            return None  # fixed geometry over storage that outlives the replay
        if op.kind is Kind.VIEW:  # a view of an input: read from the environment too
            self._bound.update(id(t) for t in outputs if not self._is_transient(t))
        if op.kind is Kind.ALLOC and not any(self._is_transient(t) for t in outputs):
            return None  # persistent allocation: the captured tensor is the storage
        args = tuple(self._template(a) for a in op.args)
        kwargs = {k: self._template(v) for k, v in {**op.kwargs, **op.host}.items()}
        step = _Step(op.func, args, kwargs)
        step.single_output = isinstance(op.outputs, torch.Tensor)
        for leaf_index, leaf in enumerate(outputs):
            if self._in_env(leaf):
                step.bind.append((leaf_index, self._slot_of(leaf)))
            elif op.kind in (Kind.COMPUTE, Kind.REFRESH, Kind.TASK):
                step.copy.append((leaf_index, leaf))
        return step

    def recompile(self, ops: list[Op], start: int, end: int) -> None:
        """Rebuild the steps of ``ops[start:end]`` after a task update replaced them."""
        for index in range(start, end):
            self.steps[index] = self._compile(ops[index])
        self._set_releases()

    def set_task_host(self, ops: list[Op], index: int) -> None:
        """Swap in the host arguments of the task ``ops[index]`` after an update.

        Host arguments hold no tensors the graph produced, so the step's slots and the
        replay's liveness are unchanged: only those keyword arguments are replaced (the
        record itself kept none of its capture-time tensors)."""
        op, step = ops[index], self.steps[index]
        if any(self._is_transient(t) for t in tensor_leaves(op.host)):
            raise ValueError(
                "a task's host arguments must not hold tensors the graph itself produced"
            )
        host = {k: self._template(v) for k, v in op.host.items()}
        step.kwargs = {**step.kwargs, **host}

    def _set_releases(self) -> None:
        last_use: dict[int, int] = {}
        for index, step in enumerate(self.steps):
            if step is None:
                continue
            for slot in _slots_in((step.args, tuple(step.kwargs.values()))):
                last_use[slot] = index
            for _, slot in step.bind:
                last_use.setdefault(slot, index)
        for slot in self._outputs.slots:
            last_use.pop(slot, None)  # read when the replay returns, released after
        releases: dict[int, list[int]] = {}
        for slot, index in last_use.items():
            releases.setdefault(index, []).append(slot)
        for index, step in enumerate(self.steps):
            if step is not None:
                step.release = tuple(releases.get(index, ()))

    def _peak_bytes(self, ops: list[Op]) -> int:
        """Bytes of transient storage live at once at the peak of a replay."""
        first: dict = {}
        last: dict = {}
        for index, op in enumerate(ops):
            for leaf in tensor_leaves((op.args, op.kwargs, op.outputs)):
                key = storage_key(leaf)
                if key in self.layout.transient:
                    first.setdefault(key, index)
                    last[key] = index
        events: list[tuple[int, int]] = []
        for key, start in first.items():
            events.append((start, self.layout.transient[key]))
            events.append((last[key] + 1, -self.layout.transient[key]))
        live = peak = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
            live += delta
            peak = max(peak, live)
        return peak

    def _forget_transients(self, ops: list[Op], kept_ops: set[int]) -> None:
        """Let capture-time transient tensors go, except those task updates re-issue with."""
        for index, op in enumerate(ops):
            if index in kept_ops:
                continue
            op.args = self._without_transients(op.args)
            op.kwargs = self._without_transients(op.kwargs)
            op.outputs = self._without_transients(op.outputs)

    def _without_transients(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return Slot(-1) if self._in_env(value) else value
        if type(value) in (list, tuple):
            return type(value)(self._without_transients(v) for v in value)
        if type(value) is dict:
            return {k: self._without_transients(v) for k, v in value.items()}
        return value

    # -- replay -----------------------------------------------------------------------
    def run(self, inputs: Sequence[torch.Tensor] | None = None) -> Any:
        """Replay once on ``inputs``; returns this replay's outputs (see ``outputs``)."""
        env = self._env
        self._bind_inputs(env, inputs)
        try:
            for step in self.steps:
                if step is not None:
                    step.run(env)
            return self._outputs.build(env)
        finally:
            for index in range(len(env)):
                env[index] = None

    def _bind_inputs(self, env: list, inputs: Sequence[torch.Tensor] | None) -> None:
        if not self._inputs:
            return
        given = -1 if inputs is None else len(inputs)
        if given != len(self._inputs):
            raise GraphReplayError(
                f"this graph was captured with {len(self._inputs)} input tensors and reads "
                f"them at replay; got {'none' if inputs is None else given}"
            )
        for index, ((slot, shape, dtype), tensor) in enumerate(zip(self._inputs, inputs)):
            if tensor.shape != shape or tensor.dtype != dtype:
                raise GraphReplayError(
                    f"input {index}: captured as {tuple(shape)} {dtype}, "
                    f"replayed with {tuple(tensor.shape)} {tensor.dtype}"
                )
            env[slot] = tensor

    def kept_bytes(self) -> int:
        """Bytes of transient storage that records keep for task updates."""
        storages = {storage_key(t): t.untyped_storage().nbytes() for t in self._kept}
        return sum(n for k, n in storages.items() if k in self.layout.transient)


class _OutputTemplate:
    """The capture's outputs with replay-local tensors as slots; ``build`` fills them."""

    def __init__(self, outputs: Any, template: Callable[[Any], Any]) -> None:
        leaves, self.spec = tree_flatten(outputs)
        # Not the leaves themselves: a replay-local output of the capture would stay alive.
        self.items = [template(leaf) for leaf in leaves]
        self.slots = [item.index for item in self.items if type(item) is Slot]
        self.trivial = not self.slots

    def build(self, env: list) -> Any:
        if self.trivial:
            return tree_unflatten(self.items, self.spec)
        return tree_unflatten([_resolve(item, env) for item in self.items], self.spec)


def _record_values(op: Op) -> tuple:
    return (op.args, op.kwargs, op.outputs)


def _slots_in(value: Any) -> list[int]:
    found = []
    for item in value:
        kind = type(item)
        if kind is Slot:
            found.append(item.index)
        elif kind is _Nested:
            found.extend(_slots_in(item.items))
        elif kind in (list, tuple):
            found.extend(_slots_in(item))
    return found


def substitute(value: Any, aliases: dict[int, Any]) -> Any:
    """``value`` with each tensor whose id is in ``aliases`` replaced by its alias."""
    if isinstance(value, torch.Tensor):
        return aliases.get(id(value), value)
    if type(value) in (list, tuple):
        return type(value)(substitute(v, aliases) for v in value)
    if type(value) is dict:
        return {k: substitute(v, aliases) for k, v in value.items()}
    return value
