"""vLLM's static graph wrapper over ``npu_graphs.GraphWrapper``.

vLLM sets, per forward, a ``CUDAGraphMode`` runtime mode and a ``BatchDescriptor``
in its forward context. This wrapper maps them to npu-graphs' ``RuntimeMode`` and
batch key: a wrapper whose mode matches captures the key on first sight (during
start-up capture) and replays it afterwards. A FULL wrapper is a thin adapter over the
bridge's graph component (:class:`~npu_vllm_bridge.graphs.full_graphs.FullGraphs`),
whose replay brings the captured attention tasks to the step's plan in the order the
graph backend takes; a PIECEWISE wrapper (no tasks) holds an npu-graphs ``GraphWrapper``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_map
from vllm.compilation import monitor
from vllm.compilation.monitor import validate_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.sequence import IntermediateTensors

from npu_graphs import GraphWrapper, RuntimeMode, get_backend, graph_dispatch
from npu_vllm_bridge.graphs.counters import GraphCounters, count_eager_step
from npu_vllm_bridge.graphs.full_graphs import FullGraphs, count_vllm_capture, graph_backend_name
from npu_vllm_bridge.settings import current_settings

_RUNTIME_MODES = {
    CUDAGraphMode.FULL: RuntimeMode.FULL,
    CUDAGraphMode.PIECEWISE: RuntimeMode.PIECEWISE,
}


_WRAPPERS: weakref.WeakSet[Any] = weakref.WeakSet()


def live_wrappers() -> list[Any]:
    """The bridge's graph wrappers still alive in this process (each has
    ``clear_graphs()``, ``vllm_config`` and its ``counters``): every
    :class:`BridgeGraphWrapper` and those handed to :func:`track_wrapper`."""
    return list(_WRAPPERS)


def wrappers_of(vllm_config: Any) -> list[Any]:
    """The live wrappers of the engine whose config is ``vllm_config``: those built on
    its compilation config (a drafter's model may be built on a copy of the engine's
    config, which keeps the compilation config)."""
    compilation_config = vllm_config.compilation_config
    return [
        wrapper
        for wrapper in live_wrappers()
        if wrapper.vllm_config.compilation_config is compilation_config
    ]


def track_wrapper(wrapper: Any) -> None:
    """Count ``wrapper`` (it has ``clear_graphs()``) among :func:`live_wrappers`, whose
    graphs the memory profile drops after measuring them."""
    _WRAPPERS.add(wrapper)


class RunnableProxy:
    """What vLLM reads of a model through its wrappers: ``unwrap()`` and the wrapped
    runnable's attributes."""

    runnable: Any

    def unwrap(self) -> Callable[..., Any]:
        runnable = self.runnable
        return runnable.unwrap() if hasattr(runnable, "unwrap") else runnable

    def __getattr__(self, name: str) -> Any:
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(name)
        return getattr(runnable, name)


class BridgeGraphWrapper(RunnableProxy):
    """Static graph wrapper for vLLM 0.32 (``Platform.get_static_graph_wrapper_cls``).

    Attributes:
        counters: what it counted (its FULL graphs' component's, or its PIECEWISE
            captures and piece replays); the steps without graphs of the model
            forward it counts steps of (``counts_steps``).

    Args:
        runnable: the model (FULL) or a piece of the compiled model (PIECEWISE).
        vllm_config: vLLM's config.
        runtime_mode: ``CUDAGraphMode.FULL`` or ``CUDAGraphMode.PIECEWISE``.
        num_attention_layers: attention tasks each FULL capture must record
            (checked at capture); ``None`` to skip the check.
        graph_backend: npu-graphs backend name; default: the current platform's.
        first_piece: whether this PIECEWISE wrapper holds the model's first piece (it
            counts the steps); default: what vLLM's piecewise backend says of itself
            (``runnable.is_first_graph``).
        **kwargs: vLLM's wrapper options (``cudagraph_options``), accepted and unused.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        vllm_config: VllmConfig,
        runtime_mode: CUDAGraphMode,
        num_attention_layers: int | None = None,
        graph_backend: str | None = None,
        first_piece: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if runtime_mode not in _RUNTIME_MODES:
            raise ValueError(
                f"a graph wrapper runs FULL or PIECEWISE graphs, got runtime_mode={runtime_mode}"
            )
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.runtime_mode = runtime_mode
        self.graph_mode = _RUNTIME_MODES[runtime_mode]
        self.capture_on_first_use = current_settings().capture_on_first_use
        name = f"{type(runnable).__name__}[{runtime_mode.name}]"
        backend = get_backend(graph_backend or graph_backend_name())
        self.full: FullGraphs | None = None
        if runtime_mode == CUDAGraphMode.FULL:
            self.full = FullGraphs(
                StageTensorsAdapter(runnable),
                name=name,
                expected_tasks=num_attention_layers,
                backend=backend,
            )
            self.graphs = self.full.graphs
            self.tasks = self.full.tasks
            self.counters = self.full.counters
        else:
            self.graphs = GraphWrapper(
                StageTensorsAdapter(runnable), backend=backend, mode=self.graph_mode, name=name
            )
            self.tasks = None
            self.counters = GraphCounters()
        # One wrapper per model forward counts steps: the FULL one, else the first piece.
        if first_piece is None:
            first_piece = bool(getattr(runnable, "is_first_graph", False))
        full_graphs = vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs()
        self.first_piece = runtime_mode == CUDAGraphMode.PIECEWISE and first_piece
        self.counts_steps = runtime_mode == CUDAGraphMode.FULL or (
            self.first_piece and not full_graphs
        )
        _WRAPPERS.add(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        context = get_forward_context()
        mode = context.cudagraph_runtime_mode
        if mode != self.runtime_mode:
            if self.counts_steps and mode == CUDAGraphMode.NONE:
                self._count_eager_step(context.batch_descriptor, context.attn_metadata)
            return self.runnable(*args, **kwargs)
        key = context.batch_descriptor
        if key is None:
            raise ValueError(f"{self.runtime_mode.name} graph dispatch without a batch descriptor")
        args, kwargs = to_stage_tensors((args, kwargs))
        if not self.graphs.has_graph(key):
            return from_stage_tensors(self._capture(key, args, kwargs))
        if self.full is not None:
            return from_stage_tensors(self.full.replay(key, context.attn_metadata, *args, **kwargs))
        counters = self.counters
        counters.replayed_pieces += 1
        counters.piecewise_steps += self.first_piece
        with graph_dispatch(self.graph_mode, key):
            return from_stage_tensors(self.graphs(*args, **kwargs))

    def _capture(self, key: Any, args: tuple, kwargs: dict) -> Any:
        """Capture ``key``: at start-up, or (``capture_on_first_use``) at its first step
        (start-up captures' time and memory are counted by the runner)."""
        at_first_use = not monitor.cudagraph_capturing_enabled
        if not self.capture_on_first_use:
            validate_cudagraph_capturing_enabled()
        if self.full is not None:
            return self.full.capture(key, *args, at_first_use=at_first_use, **kwargs)
        start = time.perf_counter()
        with graph_dispatch(self.graph_mode, key):
            outputs = self.graphs(*args, **kwargs)
        counters = self.counters
        counters.captured += 1
        count_vllm_capture()
        if at_first_use:
            counters.capture_seconds += time.perf_counter() - start
            counters.capture_bytes = self.graphs.backend.memory_in_use()
        return outputs

    def _count_eager_step(self, key: Any, attn_metadata: Any) -> None:
        count_eager_step(
            self.counters,
            getattr(key, "num_tokens", None),
            self.vllm_config.compilation_config.max_cudagraph_capture_size,
            lambda: is_decode_step(attn_metadata),
        )

    def has_graph(self, key: Any) -> bool:
        return self.graphs.has_graph(key)

    def clear_graphs(self) -> None:
        """Drop every graph (after the memory profile's captures, which are not counted)."""
        if self.full is not None:
            self.full.clear(forget_counts=True)
        else:
            self.graphs.reset()


class StageTensors(NamedTuple):
    """vLLM's ``IntermediateTensors`` (the hidden states a pipeline stage passes on) as
    a pytree: npu-graphs finds a graph's inputs and outputs among the tensor leaves of
    its arguments and results, and an ``IntermediateTensors`` would be one opaque leaf
    (a host graph would return the capture's hidden states at every replay)."""

    tensors: dict[str, torch.Tensor]


def to_stage_tensors(tree: Any) -> Any:
    """``tree`` with each ``IntermediateTensors`` as a :class:`StageTensors`."""
    return tree_map(
        lambda x: StageTensors(dict(x.tensors)) if isinstance(x, IntermediateTensors) else x,
        tree,
        is_leaf=lambda x: isinstance(x, IntermediateTensors),
    )


def from_stage_tensors(tree: Any) -> Any:
    """``tree`` with each :class:`StageTensors` back as an ``IntermediateTensors``."""
    return tree_map(
        lambda x: IntermediateTensors(dict(x.tensors)) if isinstance(x, StageTensors) else x,
        tree,
        is_leaf=lambda x: isinstance(x, StageTensors),
    )


class StageTensorsAdapter:
    """The runnable a graph records: takes and returns :class:`StageTensors` where the
    model takes and returns ``IntermediateTensors``."""

    def __init__(self, runnable: Callable[..., Any]) -> None:
        self.runnable = runnable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = from_stage_tensors((args, kwargs))
        return to_stage_tensors(self.runnable(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(name)
        return getattr(runnable, name)


def is_decode_step(attn_metadata: Any) -> bool:
    """Whether the step's plans hold decodes only (speculative verify steps included)."""
    if not isinstance(attn_metadata, dict) or not attn_metadata:
        return False
    plan = getattr(next(iter(attn_metadata.values())), "plan", None)
    return getattr(plan, "num_prefills", None) == 0
