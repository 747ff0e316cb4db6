"""Runtime graph modes and the per-step dispatch context that graph wrappers read.

An engine sets, once per step, which graph mode runs and under which batch key::

    with graph_dispatch(RuntimeMode.FULL, key=64):
        hidden = model(input_ids[:64], positions[:64])

Every :class:`~npu_graphs.GraphWrapper` reads this context on each call: a wrapper
whose own mode matches captures or replays the graph for ``key``; any other wrapper
runs its callable eagerly. Wrappers therefore nest: a PIECEWISE wrapper called inside
a FULL capture runs eagerly and is captured as part of the FULL graph.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Hashable, Iterator
from dataclasses import dataclass


class RuntimeMode(enum.Enum):
    """How one step runs: eagerly, as per-layer-piece graphs, or as one full graph."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"


@dataclass(frozen=True)
class DispatchState:
    """The mode and batch key in force for the current step."""

    mode: RuntimeMode = RuntimeMode.NONE
    key: Hashable = None


_EAGER = DispatchState()
_DISPATCH: contextvars.ContextVar[DispatchState] = contextvars.ContextVar(
    "npu_graphs_dispatch", default=_EAGER
)


def current_dispatch() -> DispatchState:
    """The :class:`DispatchState` set by the innermost :func:`graph_dispatch` (eager if none)."""
    return _DISPATCH.get()


@contextlib.contextmanager
def graph_dispatch(mode: RuntimeMode, key: Hashable = None) -> Iterator[DispatchState]:
    """Run the enclosed calls under graph ``mode`` for batch ``key``.

    Args:
        mode: a :class:`RuntimeMode`. ``NONE`` makes every wrapper run eagerly.
        key: any hashable batch key (typically the padded token count, or a tuple
            such as ``(num_tokens, uniform_decode)``). Required unless mode is NONE.

    Raises:
        TypeError: ``mode`` is not a RuntimeMode, or ``key`` is not hashable.
        ValueError: a graph mode was given without a key.
    """
    if not isinstance(mode, RuntimeMode):
        raise TypeError(f"mode must be a RuntimeMode, got {type(mode).__name__}: {mode!r}")
    if mode is not RuntimeMode.NONE and key is None:
        raise ValueError(f"graph_dispatch({mode.name}) needs a batch key, got None")
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"batch key must be hashable, got {type(key).__name__}: {key!r}") from None
    state = DispatchState(mode, key)
    token = _DISPATCH.set(state)
    try:
        yield state
    finally:
        _DISPATCH.reset(token)
