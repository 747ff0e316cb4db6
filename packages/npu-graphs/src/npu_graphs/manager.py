"""FullGraphManager: capture phases, per-step graph-mode choice, static outputs.

The engine owns static input buffers (token ids, positions, ...) of the largest
size and a ``forward(batch)`` that reads them sliced to ``batch.num_tokens``. The
manager captures ``forward`` for every planned size, then per step picks the mode:

* a uniform decode batch runs the uniform-decode graph of its padded size;
* any other batch runs the mixed-batch mode (FULL: the manager's graph; PIECEWISE:
  forward under piecewise dispatch, so piecewise wrappers inside it replay);
* a batch no graph fits, or whose size was not captured, runs eagerly.

::

    manager = FullGraphManager(forward, plan, backend="cuda", tasks=registry)
    manager.capture()
    out = manager.run(num_tokens, uniform_decode=True, step=step)  # update + replay

Not used by the bridge yet; vLLM's model runner chooses the mode and batch key per
step itself, and the bridge wraps the model in :class:`~npu_graphs.GraphWrapper`
directly. The manager is for engines without such a dispatcher (tested on the host
backend and on CUDA).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from npu_graphs.backends import GraphBackend, get_backend
from npu_graphs.capture import CaptureReport, capture_all
from npu_graphs.modes import RuntimeMode, current_dispatch, graph_dispatch
from npu_graphs.planner import CapturePlan
from npu_graphs.session import active_session
from npu_graphs.tasks import TaskRegistry
from npu_graphs.wrapper import GraphWrapper

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchDescriptor:
    """The graph key of a step: padded token count and whether it is a uniform decode batch."""

    num_tokens: int
    uniform_decode: bool = False


@dataclass(frozen=True)
class StepDispatch:
    """How one step runs: its mode, its (padded) batch key, and its real token count."""

    mode: RuntimeMode
    batch: BatchDescriptor
    num_tokens: int


class FullGraphManager:
    """Captures and runs a model's forward as full (or piecewise) graphs per batch size.

    Not used by the bridge yet (see the module docstring).

    Args:
        forward: ``forward(batch: BatchDescriptor) -> Tensor | tuple[Tensor, ...]``; reads
            the caller's static inputs sliced to ``batch.num_tokens`` and returns outputs
            whose first dimension is ``batch.num_tokens``.
        plan: the :class:`~npu_graphs.CapturePlan` (sizes and uniform-decode sizes).
        backend: graph backend (instance, name or device).
        mixed_mode: mode for mixed batches: FULL, PIECEWISE or NONE (eager).
        uniform_decode_mode: mode for uniform decode batches: FULL or NONE (then they
            run as mixed batches).
        tasks: the registry of the updatable tasks inside ``forward``.
        name: used in logs and errors.
        progress: show a progress bar while capturing.
    """

    def __init__(
        self,
        forward: Callable[[BatchDescriptor], Any],
        plan: CapturePlan,
        *,
        backend: GraphBackend | str | torch.device | None = None,
        mixed_mode: RuntimeMode = RuntimeMode.FULL,
        uniform_decode_mode: RuntimeMode = RuntimeMode.FULL,
        tasks: TaskRegistry | None = None,
        name: str = "model",
        progress: bool = True,
    ) -> None:
        if not callable(forward):
            raise TypeError(f"forward must be callable, got {type(forward).__name__}")
        if not isinstance(plan, CapturePlan):
            raise TypeError(f"plan must be a CapturePlan, got {type(plan).__name__}")
        if not isinstance(mixed_mode, RuntimeMode):
            raise TypeError(f"mixed_mode must be a RuntimeMode, got {mixed_mode!r}")
        if uniform_decode_mode not in (RuntimeMode.FULL, RuntimeMode.NONE):
            raise ValueError(
                f"uniform_decode_mode must be FULL or NONE, got {uniform_decode_mode!r}"
            )
        self.forward = forward
        self.plan = plan
        self.backend = get_backend(backend)
        self.mixed_mode = mixed_mode
        self.uniform_decode_mode = uniform_decode_mode
        self.tasks = tasks
        self.name = name
        self.progress = progress
        self._graph = GraphWrapper(
            self._forward_to_static,
            backend=self.backend,
            mode=RuntimeMode.FULL,
            tasks=tasks,
            name=name,
        )
        self._captured: set[tuple[RuntimeMode, BatchDescriptor]] = set()
        self._outputs: Any = None

    # -- capture ----------------------------------------------------------------------
    def capture(self) -> list[CaptureReport]:
        """Capture every planned graph, largest first: mixed batches, then uniform decode."""
        reports = []
        phases = [(self.mixed_mode, self.plan.capture_order(), False)]
        if self.uniform_decode_mode is not RuntimeMode.NONE:
            phases.append((self.uniform_decode_mode, self.plan.capture_order(True), True))
        for mode, sizes, uniform in phases:
            if mode is RuntimeMode.NONE or not sizes:
                continue
            keys = [BatchDescriptor(size, uniform) for size in sizes]
            self._ensure_outputs(keys[0])
            desc = (
                f"Capturing {self.name} ({'uniform decode' if uniform else 'mixed'}, {mode.name})"
            )
            reports.append(
                capture_all(
                    keys,
                    lambda key, m=mode: self._capture_one(m, key),
                    backend=self.backend,
                    desc=desc,
                    progress=self.progress,
                )
            )
        return reports

    def _capture_one(self, mode: RuntimeMode, key: BatchDescriptor) -> None:
        with graph_dispatch(mode, key):
            self._graph(key)
        self._captured.add((mode, key))

    def _ensure_outputs(self, largest: BatchDescriptor) -> None:
        """Allocate the static outputs from one eager run at the largest size."""
        if self._outputs is not None:
            return
        sample = self.forward(largest)
        self._outputs = tree_map(_static_like(self.plan_max_tokens()), sample)

    def plan_max_tokens(self) -> int:
        """Rows of the static output buffers: the largest planned graph size."""
        return max(self.plan.sizes[-1], *(self.plan.uniform_decode_sizes or (0,)))

    def _forward_to_static(self, batch: BatchDescriptor) -> Any:
        outputs = self.forward(batch)
        if self._outputs is None or current_dispatch().mode is not RuntimeMode.FULL:
            return outputs
        if active_session() is None:
            return outputs
        n = batch.num_tokens
        return tree_map(
            lambda s, o: s[:n].copy_(o) if isinstance(o, torch.Tensor) else o,
            self._outputs,
            outputs,
        )

    # -- per step ---------------------------------------------------------------------
    def dispatch(self, num_tokens: int, uniform_decode: bool = False) -> StepDispatch:
        """Choose the mode and padded key for a step of ``num_tokens`` tokens."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        if uniform_decode and self.uniform_decode_mode is not RuntimeMode.NONE:
            size = self.plan.padded_uniform_decode_size(num_tokens)
            key = BatchDescriptor(size, True) if size else None
            if key and (self.uniform_decode_mode, key) in self._captured:
                return StepDispatch(self.uniform_decode_mode, key, num_tokens)
        if self.mixed_mode is not RuntimeMode.NONE:
            size = self.plan.padded_size(num_tokens)
            key = BatchDescriptor(size, False) if size else None
            if key and (self.mixed_mode, key) in self._captured:
                return StepDispatch(self.mixed_mode, key, num_tokens)
        return StepDispatch(
            RuntimeMode.NONE, BatchDescriptor(num_tokens, uniform_decode), num_tokens
        )

    def run(self, num_tokens: int, uniform_decode: bool = False, step: Any = None) -> Any:
        """Run one step; returns outputs sliced to ``num_tokens`` rows.

        The caller has filled its static inputs for the padded size of
        ``dispatch(num_tokens, uniform_decode)`` first (padding rows included). With
        ``step`` and a task registry, the graph's tasks are updated before replay.
        """
        chosen = self.dispatch(num_tokens, uniform_decode)
        graphed = chosen.mode is not RuntimeMode.NONE
        if graphed and step is not None and self.tasks is not None and chosen.batch in self.tasks:
            self.tasks.update(chosen.batch, step)
        with graph_dispatch(chosen.mode, chosen.batch if graphed else None):
            outputs = self._graph(chosen.batch)
        return tree_map(lambda o: o[:num_tokens] if isinstance(o, torch.Tensor) else o, outputs)

    def captured_keys(self) -> list[tuple[RuntimeMode, Hashable]]:
        """(mode, key) of every captured graph."""
        return sorted(
            self._captured, key=lambda mk: (mk[0].value, mk[1].uniform_decode, mk[1].num_tokens)
        )


def _static_like(rows: int) -> Callable[[Any], Any]:
    def allocate(sample: Any) -> Any:
        if not isinstance(sample, torch.Tensor):
            raise TypeError(f"forward must return tensors, got {type(sample).__name__}")
        return sample.new_empty((rows, *sample.shape[1:]))

    return allocate
