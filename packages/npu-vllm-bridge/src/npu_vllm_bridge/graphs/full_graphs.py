"""The bridge's FULL graphs of one model (or drafter) forward: its one graph component.

V1's graph wrapper (``graphs/wrapper.py``), V2's graph manager (``graphs/v2_graphs.py``),
the drafters' graphs and the micro-batch wrapper's unsplit steps all hold one
:class:`FullGraphs` and go through it; none of them touches npu-graphs' replay itself.

API::

    full = FullGraphs(runnable, name="LlamaForCausalLM[FULL]", expected_tasks=num_layers,
                      role=MODEL, pool=None)
    full.capture(key, *args, at_first_use=False, **kwargs) -> outputs
        # capture ``runnable(*args, **kwargs)`` as the graph of ``key`` (a batch
        # descriptor); the attention ops record into ``full.tasks``, named by layer.
    full.replay(key, attn_metadata, *args, **kwargs) -> outputs
        # the step: ONE call into npu-graphs, ``GraphWrapper.replay_step(key,
        # {layer_name: metadata}, ...)``, which orders update and replay as the backend
        # takes them (NPU: replay launched, then the update on its update stream behind
        # events; CUDA: fixed buffers filled, then the replay; host: update, then run).
    full.estimate_bytes(descs, capture_one) -> int
        # the graphs' own bytes over ``descs``, from capturing the largest and the
        # smallest (``capture_one(desc)``) and a linear fit (``memory_estimate.py``).
    full.has_graph(key) / full.entry(key) / full.clear() / full.backend / full.tasks
    full.counters  # GraphCounters of this component alone (its runner sums them)

``role`` names which of its ``counters`` count (``MODEL``: the main model's
``captured`` / ``replayed_steps`` / ``task_updates``; ``DRAFTER``: the drafter's
``draft_*`` ones, its captures also in ``captured``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from vllm.compilation.counter import compilation_counter

from npu_graphs import (
    GraphBackend,
    GraphEntry,
    GraphWrapper,
    RuntimeMode,
    TaskRegistry,
    get_backend,
    graph_dispatch,
)
from npu_vllm_bridge.graphs.counters import GraphCounters
from npu_vllm_bridge.graphs.memory_estimate import estimate_own_bytes
from npu_vllm_bridge.settings import current_settings
from npu_vllm_bridge.vllm_seam import set_cudagraphs_captured_count

MODEL = "model"
DRAFTER = "drafter"
_ROLES = (MODEL, DRAFTER)


def count_vllm_capture() -> None:
    """One more graph in vLLM's compilation counter, as vLLM's ``CUDAGraphWrapper`` counts."""
    set_cudagraphs_captured_count(compilation_counter.num_cudagraph_captured + 1)


def graph_backend_name() -> str:
    """The npu-graphs backend of the current platform (``npu`` or ``host``)."""
    name = current_settings().graph_backend
    if name is None:
        raise ValueError(
            "the current platform's bridge_settings name no npu-graphs backend "
            "(graph_backend); the bridge's graph wrapper needs one"
        )
    return name


def per_layer_metadata(attn_metadata: Any) -> dict[str, Any]:
    """The step's ``{layer_name: attn_metadata}``: each attention task takes its layer's.

    Raises:
        ValueError: vLLM's forward context holds no per-layer dict (micro-batched
            steps pass a list of them, which go through the micro-batch wrapper).
    """
    if not isinstance(attn_metadata, dict):
        raise ValueError(
            "FULL graph replay needs the step's attention metadata as {layer_name: metadata}, "
            f"got {type(attn_metadata).__name__}"
        )
    return attn_metadata


class FullGraphs:
    """FULL graphs of ``runnable`` keyed by batch descriptor, with their attention tasks.

    Args:
        runnable: what a graph records (the model, or a forward function of vLLM's).
        name: used in logs and errors.
        expected_tasks: attention tasks each capture must record (checked at capture);
            ``None`` to skip the check.
        role: ``MODEL`` or ``DRAFTER``: which of :attr:`counters` its captures and
            replays count in.
        backend: npu-graphs backend (name or instance); default: the platform's.
        pool: graph memory pool; default: the backend's shared pool.
        task_label: the task registry's name (in errors).
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        *,
        name: str,
        expected_tasks: int | None = None,
        role: str = MODEL,
        backend: GraphBackend | str | None = None,
        pool: Any = None,
        task_label: str = "attention",
    ) -> None:
        if role not in _ROLES:
            raise ValueError(f"role must be one of {_ROLES}, got {role!r}")
        self.role = role
        self.tasks = TaskRegistry(task_label, expected_tasks=expected_tasks)
        self.graphs = GraphWrapper(
            runnable,
            backend=get_backend(backend or graph_backend_name()),
            mode=RuntimeMode.FULL,
            pool=pool,
            tasks=self.tasks,
            name=name,
        )
        self.counters = GraphCounters()

    @property
    def backend(self) -> GraphBackend:
        return self.graphs.backend

    # -- capture ------------------------------------------------------------------------
    def capture(self, key: Hashable, *args: Any, at_first_use: bool = False, **kwargs: Any) -> Any:
        """Capture ``runnable(*args, **kwargs)`` as the graph of ``key``; returns the
        capture's outputs. ``at_first_use``: a capture at a step's first sight of ``key``
        (its time and the graphs' memory are counted here; start-up captures are counted
        by the runner).

        Raises:
            GraphCaptureError: the capture failed.
        """
        start = time.perf_counter()
        with graph_dispatch(RuntimeMode.FULL, key):
            outputs = self.graphs(*args, **kwargs)
        count_vllm_capture()
        counters = self.counters
        counters.captured += 1
        if self.role == DRAFTER:
            counters.draft_captured += 1
        if at_first_use:
            counters.capture_seconds += time.perf_counter() - start
            counters.capture_bytes = self.backend.memory_in_use()
        return outputs

    # -- replay -------------------------------------------------------------------------
    def replay(self, key: Hashable, attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        """Replay the graph of ``key`` with its attention tasks brought to the step's
        ``{layer_name: attn_metadata}`` (not read when ``key`` has no task); returns the
        graph's outputs. ``args``/``kwargs``: the step's inputs (host graphs read them;
        device graphs read the captured addresses).

        Raises:
            KeyError: no graph for ``key``.
            ValueError: ``key`` has tasks and ``attn_metadata`` is no per-layer dict.
        """
        updated = bool(self.tasks.num_tasks(key))
        step = per_layer_metadata(attn_metadata) if updated else None
        self._count_replay(updated)
        return self.graphs.replay_step(key, step, *args, **kwargs)

    def _count_replay(self, updated: bool) -> None:
        counters = self.counters
        if self.role == DRAFTER:
            counters.draft_replayed_steps += 1
            counters.draft_task_updates += updated
        else:
            counters.replayed_steps += 1
            counters.task_updates += updated

    # -- memory estimate ----------------------------------------------------------------
    def estimate_bytes(self, descs: Sequence[Any], capture_one: Callable[[Any], None]) -> int:
        """The bytes the graphs of ``descs`` keep for their own, from capturing the
        largest and the smallest (``capture_one(desc)``) and a linear fit
        (:func:`~npu_vllm_bridge.graphs.memory_estimate.estimate_own_bytes`; the shared
        pool is the caller's to measure, once around every group)."""
        return estimate_own_bytes(self.backend, descs, capture_one)

    # -- bookkeeping --------------------------------------------------------------------
    def has_graph(self, key: Hashable) -> bool:
        """True if a graph is captured for ``key``."""
        return self.graphs.has_graph(key)

    def entry(self, key: Hashable) -> GraphEntry:
        """npu-graphs' entry of ``key`` (KeyError if none)."""
        return self.graphs.entry(key)

    def clear(self, forget_counts: bool = False) -> None:
        """Drop every graph and its tasks; ``forget_counts``: zero :attr:`counters` (after
        the memory profile's captures)."""
        self.graphs.reset()
        if forget_counts:
            self.counters.reset()

    def __repr__(self) -> str:
        return f"FullGraphs({self.graphs.name}, role={self.role}, graphs={len(self.graphs.keys())})"
