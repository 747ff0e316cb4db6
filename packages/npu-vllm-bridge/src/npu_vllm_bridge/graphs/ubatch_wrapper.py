"""Micro-batch overlap (vLLM's DBO) in the place of vLLM's ``UBatchWrapper``.

With ``--enable-dbo``, vLLM 0.32's model runner splits a step of a data-parallel MoE
model into micro-batches when every DP rank has enough tokens (its thresholds, agreed
across ranks), builds one attention-metadata dict per micro-batch, and calls the model
with the step's ``ubatch_slices`` in the forward context. Its ``UBatchWrapper`` is
CUDA's (CUDA streams, SM control, ``torch.cuda.CUDAGraph``); :class:`BridgeUBatchWrapper`
takes its place, its split steps run by :class:`SplitForwards` on npu-graphs'
``MicroBatchRunner`` (Model Runner V2's micro-batch runner, ``v2_ubatch.py``, runs its
split steps through one too):

* each micro-batch runs the model on its own thread with its own forward context (its
  attention metadata and data-parallel token counts), on the graph backend's streams
  (the NPU's through the ``npu`` backend; host stand-ins in host mode);
* the threads take turns: a micro-batch hands over at each MoE dispatch and combine
  (:func:`micro_batch_collective`, around the communicator's ``all_gatherv`` and
  ``reduce_scatterv``), after issuing the collective on its communication stream, so
  the other micro-batch's compute is issued meanwhile. Every rank splits alike and
  hands over in the same order, so the ranks' collectives pair up;
* FULL graphs: both micro-batches of a split step are captured into one graph per
  (batch descriptor, split), halves of any sizes vLLM's split gives. For each replay
  every micro-batch's attention tasks are re-issued with that micro-batch's own plan
  (host graphs: before the replay; NPU: right after it is launched, each task waiting
  on the device for its update); nothing synchronizes the host or the device (the NPU
  backend orders its update stream after the previous replay by an event);
* a step vLLM does not split runs as without DBO: through the bridge's FULL graph
  wrapper, or eagerly.

vLLM's own hand-over points (``dbo_yield`` in the MoE kernels' asynchronous
prepare/finalize, DeepEP's and NIXL's) are not used: the MoE kernels the bridge runs
under data parallelism gather and reduce-scatter through the communicator. What vLLM
keeps per micro-batch (a MoE layer's shared-expert output, held across the combine;
workspaces) it indexes by ``dbo_current_ubatch_id()``, and what vLLM 0.33 writes per
token of a micro-batch by ``dbo_current_ubatch_token_offset()``; both read vLLM's own
micro-batch threads: :func:`install_micro_batch_ids` points the vLLM modules that
imported them at :func:`micro_batch_id` and :func:`micro_batch_token_offset`, this
wrapper's micro-batch index and first row.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.compilation import monitor
from vllm.compilation.monitor import validate_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import (
    DPMetadata,
    ForwardContext,
    create_forward_context,
    get_forward_context,
    is_forward_context_available,
    override_forward_context,
)
from vllm.logger import init_logger

from npu_graphs import (
    MicroBatchContext,
    MicroBatchRunner,
    RuntimeMode,
    TaskRegistry,
    get_backend,
    graph_dispatch,
)
from npu_vllm_bridge.graphs.counters import GraphCounters
from npu_vllm_bridge.graphs.full_graphs import (
    count_vllm_capture,
    graph_backend_name,
    per_layer_metadata,
)
from npu_vllm_bridge.graphs.wrapper import (
    BridgeGraphWrapper,
    RunnableProxy,
    is_decode_step,
    track_wrapper,
)
from npu_vllm_bridge.settings import PREFIX, current_settings
from npu_vllm_bridge.vllm_seam import (
    DBO_CURRENT_UBATCH_ID,
    DBO_CURRENT_UBATCH_TOKEN_OFFSET,
    install_forward_context,
    rebind_in_loaded_modules,
    ubatch_wrapper_bypassed,
)

logger = init_logger(f"vllm.{__name__}")

# The model's token-indexed keyword inputs, split along their first dimension.
_TOKEN_INPUTS = ("input_ids", "positions", "inputs_embeds")


@dataclass
class _SplitStep:
    """What the micro-batch threads of one split forward read."""

    runnable: Callable[..., Any]  # the model
    contexts: list[ForwardContext]  # one per micro-batch
    names: tuple[str, ...]  # the split inputs' keyword names, in order
    other_kwargs: dict[str, Any]  # the rest, passed to every micro-batch as given
    token_offsets: tuple[int, ...]  # each micro-batch's first row in the step's batch
    inference_mode: bool
    grad_enabled: bool
    num_threads: int
    runs: int = 0  # forwards run by the micro-batch threads (a capture runs more than one)
    yields: int = 0


@dataclass
class _Running:
    """The micro-batch this thread runs, and its step."""

    ctx: MicroBatchContext
    step: _SplitStep
    forward_context: ForwardContext

    def resume(self) -> None:
        """This micro-batch's turn (again): its forward context is vLLM's current one."""
        install_forward_context(self.forward_context)

    def hand_over(self) -> None:
        """Pass the turn (if another micro-batch is left); resume when it comes back."""
        if self.ctx.yield_turn():
            self.step.yields += 1
            self.resume()


_THREAD = threading.local()


def current_micro_batch() -> MicroBatchContext | None:
    """The micro-batch this thread runs (inside a split forward), else None."""
    running = getattr(_THREAD, "running", None)
    return running.ctx if running is not None else None


def micro_batch_id() -> int:
    """vLLM's ``dbo_current_ubatch_id`` for the bridge's micro-batch threads: the index
    of the micro-batch this thread runs; elsewhere what vLLM's own answers."""
    running = getattr(_THREAD, "running", None)
    if running is not None:
        return running.ctx.index
    from vllm.v1.worker import ubatching

    return ubatching.dbo_current_ubatch_id()


def micro_batch_token_offset() -> int:
    """vLLM 0.33's ``dbo_current_ubatch_token_offset`` for the bridge's micro-batch
    threads: the first row of this thread's micro-batch in the step's batch; elsewhere
    what vLLM's own answers."""
    running = getattr(_THREAD, "running", None)
    if running is not None:
        return running.step.token_offsets[running.ctx.index]
    from vllm.v1.worker import ubatching

    return ubatching.dbo_current_ubatch_token_offset()


def install_micro_batch_ids() -> list[str]:
    """Point every loaded vLLM module that imported ``dbo_current_ubatch_id`` (or
    ``dbo_current_ubatch_token_offset``) by name at :func:`micro_batch_id` (or
    :func:`micro_batch_token_offset`); returns the patched ``module.name``s. Call after
    the model is loaded."""
    return rebind_in_loaded_modules(
        {
            DBO_CURRENT_UBATCH_ID: micro_batch_id,
            DBO_CURRENT_UBATCH_TOKEN_OFFSET: micro_batch_token_offset,  # vLLM 0.33
        }
    )


class _VllmUBatchWrapperBypassed:
    """Stands in for vLLM's ``UBatchWrapper`` while vLLM's GPU runner loads the model:
    "wrapping" hands the model back (the bridge wraps it after)."""

    def __new__(cls, runnable: Any, *args: Any, **kwargs: Any) -> Any:
        return runnable


def vllm_ubatch_wrapper_bypassed() -> contextlib.AbstractContextManager[None]:
    """vLLM's GPU model runner's ``load_model`` wraps the model in its CUDA
    ``UBatchWrapper`` (CUDA streams, SM control) when micro-batching is on; inside this
    block it leaves the model as it is. Micro-batching stays visible to the model's
    layers (a MoE layer keeps its shared-expert outputs per micro-batch)."""
    return ubatch_wrapper_bypassed(_VllmUBatchWrapperBypassed)


@contextlib.contextmanager
def micro_batch_collective() -> Iterator[None]:
    """Around a collective of the MoE dispatch or combine. Inside a micro-batch, the
    enclosed work is issued on its communication stream (ordered after its compute,
    its later compute ordered after it) and the turn then passes to the other
    micro-batch; elsewhere the block just runs."""
    running: _Running | None = getattr(_THREAD, "running", None)
    if running is None:
        yield
        return
    with running.ctx.communicate():
        yield
    running.hand_over()


class SplitForwards:
    """The forwards vLLM split into micro-batches, of one model: each micro-batch on its
    thread (eagerly), or one graph of all of them per (batch key, split). V1's
    :class:`BridgeUBatchWrapper` and V2's micro-batch runner (``graphs/v2_ubatch.py``)
    both run their split steps through one of these.

    Args:
        vllm_config: vLLM's config (``parallel_config.num_ubatches`` micro-batches).
        num_attention_layers: attention tasks one micro-batch records (checked at
            each capture, times the micro-batches); ``None`` to skip the check.
        graph_backend: npu-graphs backend name; default: the current platform's.
        name: the model's name, in logs and errors.

    Attributes:
        counters: the split steps, captures and replays it counted (``split_*``, and
            its replays and captures in ``replayed_steps`` / ``captured``).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        num_attention_layers: int | None = None,
        graph_backend: str | None = None,
        name: str = "model",
    ) -> None:
        self.vllm_config = vllm_config
        self.num_micro_batches = vllm_config.parallel_config.num_ubatches
        backend = get_backend(graph_backend or graph_backend_name())
        expected = (
            None if num_attention_layers is None else num_attention_layers * self.num_micro_batches
        )
        self.tasks = TaskRegistry("attention (micro-batched)", expected_tasks=expected)
        self.runner = MicroBatchRunner(
            self._run_micro_batch,
            backend=backend,
            mode=RuntimeMode.FULL,
            tasks=self.tasks,
            name=f"{name}[micro-batched FULL]",
        )
        self.capture_on_first_use = current_settings().capture_on_first_use
        self.counters = GraphCounters()
        self._step: _SplitStep | None = None
        self._captured_inputs: dict[Any, tuple[torch.Tensor, ...]] = {}
        patched = install_micro_batch_ids()
        logger.debug("vLLM modules reading the bridge's micro-batch ids: %s", patched)

    def count_step(self, splits: tuple[int, ...], contexts: list[ForwardContext]) -> None:
        """One more split step (a forward vLLM split, however it runs)."""
        counters = self.counters
        counters.split_steps += 1
        counters.split_unequal_steps += len(set(splits)) > 1
        if all(is_decode_step(context.attn_metadata) for context in contexts):
            counters.split_decode_steps += 1
        else:
            counters.split_prefill_steps += 1

    def forward(
        self,
        runnable: Callable[..., Any],
        slices: list,
        contexts: list[ForwardContext],
        kwargs: dict[str, Any],
        key: Any = None,
    ) -> Any:
        """``runnable(**kwargs)`` as the micro-batches ``slices`` (vLLM's ``UBatchSlice``
        s), micro-batch ``i`` under forward context ``contexts[i]``: eagerly without
        ``key``; else replayed from the graph of (``key``, split), captured first if
        there is none (the tasks then take each context's attention metadata)."""
        splits = tuple(int(s.num_tokens) for s in slices)  # vLLM may give numpy ints
        inputs, step = self._split_inputs(runnable, contexts, slices, kwargs)
        if key is not None and self.runner.has_graph(key, splits):
            return self.replay(key, splits, [c.attn_metadata for c in contexts], inputs)
        self._step = step
        try:
            with override_forward_context(None):  # the threads set theirs; restored after
                if key is None:
                    return self.runner(inputs, splits)  # eagerly (no graph dispatch)
                return self._capture(key, splits, inputs)
        finally:
            self._step = None
            self.counters.split_forwards_run += step.runs
            self.counters.split_yields += step.yields

    def replay(
        self,
        key: Any,
        splits: tuple[int, ...],
        attn_metadata: list[Any],
        inputs: tuple[torch.Tensor, ...] | None = None,
    ) -> Any:
        """Replay the graph of all micro-batches of ``splits`` under ``key``, micro-batch
        ``i``'s attention tasks brought to its own plan ``attn_metadata[i]`` (a
        ``{layer_name: metadata}``): before the replay on host graphs; on the NPU after
        the replay is launched (each task waits on the device for its update).
        ``inputs``: the step's split inputs; default: the buffers the capture read.

        Raises:
            KeyError: no graph of ``splits`` under ``key``.
            ValueError: not one metadata per micro-batch.
        """
        graph_key = self.runner.graph_key(key, splits)
        if inputs is None:
            inputs = self._captured_inputs[graph_key]
        updated = bool(self.tasks.num_tasks(graph_key))
        steps = [per_layer_metadata(md) if updated else None for md in attn_metadata]
        counters = self.counters
        counters.replayed_steps += 1
        counters.split_replayed_steps += 1
        counters.task_updates += updated
        counters.split_task_updates += updated
        return self.runner.replay_step(key, splits, inputs, steps)

    def _capture(self, key: Any, splits: tuple, inputs: tuple) -> Any:
        """Capture all micro-batches of ``splits`` as one graph: at start-up, or
        (``capture_on_first_use``) at the first step of the key and split."""
        at_start_up = monitor.cudagraph_capturing_enabled
        if not self.capture_on_first_use:
            validate_cudagraph_capturing_enabled()
        start = time.perf_counter()
        with graph_dispatch(RuntimeMode.FULL, key):
            outputs = self.runner(inputs, splits)
        self._captured_inputs[self.runner.graph_key(key, splits)] = inputs
        counters = self.counters
        counters.captured += 1
        counters.split_captured += 1
        count_vllm_capture()
        if not at_start_up:
            counters.capture_seconds += time.perf_counter() - start
            counters.capture_bytes = self.runner.backend.memory_in_use()
        logger.debug("captured micro-batched graph %s split %s", key, splits)
        return outputs

    def _split_inputs(
        self,
        runnable: Callable[..., Any],
        contexts: list[ForwardContext],
        slices: list,
        kwargs: dict,
    ) -> tuple[tuple[torch.Tensor, ...], _SplitStep]:
        """The token-indexed inputs to split (a tuple of tensors) and the step's state."""
        if kwargs.get("intermediate_tensors") is not None:
            raise ValueError(f"{PREFIX} does not micro-batch pipeline stages")
        positions = kwargs.get("positions")
        if positions is not None and positions.ndim != 1:
            raise ValueError(
                f"{PREFIX} micro-batches 1-D positions only, got positions of shape "
                f"{tuple(positions.shape)} (M-RoPE)"
            )
        names = tuple(n for n in _TOKEN_INPUTS if kwargs.get(n) is not None)
        inputs = tuple(kwargs[n] for n in names)
        other = {k: v for k, v in kwargs.items() if k not in names}
        step = _SplitStep(
            runnable=runnable,
            contexts=contexts,
            names=names,
            other_kwargs=other,
            token_offsets=tuple(int(piece.token_slice.start or 0) for piece in slices),
            inference_mode=torch.is_inference_mode_enabled(),
            grad_enabled=torch.is_grad_enabled(),
            num_threads=torch.get_num_threads(),
        )
        return inputs, step

    def _run_micro_batch(self, parts: tuple[torch.Tensor, ...], ctx: MicroBatchContext) -> Any:
        """One micro-batch's forward, on its thread (MicroBatchRunner's runnable)."""
        step = self._step
        assert step is not None, "micro-batch run outside a split step"
        running = _Running(ctx, step, step.contexts[ctx.index])
        _THREAD.running = running
        step.runs += ctx.index == 0
        try:
            running.resume()
            if torch.get_num_threads() != step.num_threads:
                torch.set_num_threads(step.num_threads)
            kwargs = dict(step.other_kwargs)
            kwargs.update(zip(step.names, parts))
            with (
                torch.inference_mode(step.inference_mode),
                torch.set_grad_enabled(step.grad_enabled),
            ):
                return step.runnable(**kwargs)
        finally:
            _THREAD.running = None

    # -- bookkeeping ----------------------------------------------------------------------
    def has_graph(self, key: Any, splits: Any) -> bool:
        return self.runner.has_graph(key, splits)

    def clear(self) -> None:
        """Drop every graph of the split steps and its tasks."""
        self.runner.reset()
        self._captured_inputs.clear()


class BridgeUBatchWrapper(RunnableProxy):
    """The model, run as vLLM's micro-batches where vLLM splits a step (Model Runner V1).

    Args:
        runnable: the model.
        vllm_config: vLLM's config (``parallel_config.num_ubatches`` micro-batches).
        full_graphs: capture FULL graphs (split steps: one graph of all micro-batches
            per batch size and split; other steps: the bridge's FULL graph wrapper).
        num_attention_layers: attention tasks one micro-batch records (checked at
            each capture, times the micro-batches); ``None`` to skip the check.
        graph_backend: npu-graphs backend name; default: the current platform's.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        vllm_config: VllmConfig,
        full_graphs: bool,
        num_attention_layers: int | None = None,
        graph_backend: str | None = None,
    ) -> None:
        self.runnable = runnable
        self.vllm_config = vllm_config
        backend = graph_backend or graph_backend_name()
        self.full_graphs = full_graphs
        self.inner = (
            BridgeGraphWrapper(
                runnable, vllm_config, CUDAGraphMode.FULL, num_attention_layers, backend
            )
            if full_graphs
            else None
        )
        self.split = SplitForwards(
            vllm_config, num_attention_layers, backend, name=type(runnable).__name__
        )
        self.num_micro_batches = self.split.num_micro_batches
        self.runner, self.tasks = self.split.runner, self.split.tasks
        self.counters = self.split.counters  # its split steps (the inner wrapper counts its own)
        track_wrapper(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        context = get_forward_context()
        slices = context.ubatch_slices
        if slices is None:
            whole = self.inner if self.inner is not None else self.runnable
            return whole(*args, **kwargs)
        if args:
            raise TypeError(
                f"{PREFIX}: a micro-batched forward takes the model's inputs by keyword "
                f"(as vLLM's model runner passes them), got {len(args)} positional"
            )
        contexts = self._micro_batch_contexts(context, slices)
        self.split.count_step(tuple(int(s.num_tokens) for s in slices), contexts)
        key = context.batch_descriptor
        full = self.full_graphs and context.cudagraph_runtime_mode == CUDAGraphMode.FULL
        if not full:
            self.counters.eager_steps += self.full_graphs
            return self.split.forward(self.runnable, slices, contexts, kwargs)
        if key is None:
            raise ValueError(f"{PREFIX}: FULL micro-batched dispatch without a batch key")
        return self.split.forward(self.runnable, slices, contexts, kwargs, key=key)

    def _micro_batch_contexts(self, context: ForwardContext, slices: list) -> list[ForwardContext]:
        """One forward context per micro-batch: its attention metadata, slot mapping and
        padding mask, and its token counts across DP ranks (every rank splits its
        padded step at the same points, so micro-batch ``i`` holds as many tokens on
        every rank). Graph dispatch is off inside: the micro-batches run eagerly, or
        into the one capture of the whole split."""
        parallel = self.vllm_config.parallel_config
        attn, slots, padding = context.attn_metadata, context.slot_mapping, context.is_padding
        per_slot = isinstance(slots, list)
        contexts = []
        for index, piece in enumerate(slices):
            dp = None
            if context.dp_metadata is not None:
                counts = torch.full(
                    (parallel.data_parallel_size,), piece.num_tokens, dtype=torch.int32
                )
                dp = DPMetadata.make(parallel, piece.num_tokens, counts)
            contexts.append(
                create_forward_context(
                    attn[index] if attn is not None else None,
                    self.vllm_config,
                    dp_metadata=dp,
                    cudagraph_runtime_mode=CUDAGraphMode.NONE,
                    batch_descriptor=context.batch_descriptor,
                    slot_mapping=slots[index] if per_slot else None,
                    is_padding=padding[piece.token_slice] if padding is not None else None,
                )
            )
        return contexts

    # -- bookkeeping ----------------------------------------------------------------------
    def has_graph(self, key: Any, splits: Any = None) -> bool:
        if splits is None:
            return self.inner is not None and self.inner.has_graph(key)
        return self.split.has_graph(key, splits)

    def clear_graphs(self) -> None:
        self.split.clear()
        if self.inner is not None:
            self.inner.clear_graphs()
