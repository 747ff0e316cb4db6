"""npu-graphs graphs in vLLM's Model Runner V2, through its ``ModelCudaGraphManager``.

V2 captures and replays its FULL graphs itself (``vllm/v1/worker/gpu/cudagraph_utils.py``):
``CudaGraphManager.capture`` hard-codes ``torch.cuda.CUDAGraph``, and ``run_fullgraph``
replays with no forward context, so nothing around the model sees the step's attention
metadata. :class:`BridgeModelGraphManager` keeps everything else of vLLM's manager (the
batch descriptors to capture, the capture inputs, the persistent output buffers) and
replaces ``capture``, ``dispatch`` and ``run_fullgraph``:

* ``capture``: per descriptor, vLLM's warm-up forward, then the FULL forward captured by
  the bridge's graph component (:class:`~npu_vllm_bridge.graphs.full_graphs.FullGraphs`)
  keyed by the descriptor, the attention ops recorded as tasks named after their layers
  (``attention/tasks.py``). PIECEWISE descriptors run
  vLLM's compiled model, whose pieces the platform's ``BridgeGraphWrapper`` captures.
  With ``capture_on_first_use`` (host mode) nothing is captured at start-up: a FULL
  descriptor is captured when ``dispatch`` first picks it, before the step prepares its
  inputs (the capture's dummy inputs go through the same persistent buffers, which the
  step then fills), and PIECEWISE pieces capture themselves at their first step. Under
  vLLM's memory profiling, the largest and smallest descriptor of each mode are
  captured and the rest estimated from them (``memory_estimate.py``).
* ``dispatch``: vLLM's; the model runner's dispatch agreed across data-parallel ranks
  goes through ``dispatch_agreed`` (``graphs/v2_runner.py``), so that a descriptor is
  captured at first use only once every rank agreed on it; steps that run without
  graphs are counted (in the graph
  component's counters, ``full.counters``), a decode step larger than the largest graph
  logged once.
* a split descriptor (micro-batch overlap, ``num_ubatches`` > 1) is captured and
  replayed by the micro-batch runner (``graphs/v2_ubatch.py``): one graph of all
  micro-batches, each micro-batch's tasks brought to its own plan, its outputs copied
  into the persistent hidden states;
* ``run_fullgraph(desc)``: the step's ``{layer_name: attn_metadata}`` (left by the model
  runner in :attr:`BridgeModelGraphManager.step_attn_metadata`, from the model state's
  ``prepare_attn``) goes to ``FullGraphs.replay``, which replays with the tasks brought
  to it in the order the graph backend takes (npu-graphs' ``replay_step``).

The model runners install the class where vLLM builds its manager (see
``graphs/v2_runner.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.worker.gpu.cudagraph_utils import (
    BatchExecutionDescriptor,
    CreateForwardFn,
    CudaGraphManager,
    ModelCudaGraphManager,
)

from npu_graphs import capture_all
from npu_vllm_bridge.attention.tasks import count_attention_tasks
from npu_vllm_bridge.graphs.counters import count_eager_step
from npu_vllm_bridge.graphs.full_graphs import MODEL, FullGraphs
from npu_vllm_bridge.settings import current_settings
from npu_vllm_bridge.vllm_seam import (
    capture_descs,
    capture_mem_samples,
    graphs_captured,
    set_graphs_captured,
)

logger = init_logger(f"vllm.{__name__}")


class NpuGraphsCapture(CudaGraphManager):
    """``CudaGraphManager``'s capture loop and FULL replay over npu-graphs.

    Placed after ``ModelCudaGraphManager`` in :class:`BridgeModelGraphManager`'s
    bases, so that vLLM's model capture (inputs, outputs) calls this capture loop.
    """

    full: FullGraphs | None = None  # vLLM's ``graphs`` maps descriptors to its entries
    step_attn_metadata: dict[str, Any] | None = None
    capture_on_first_use: bool = False
    profiled_bytes: int = 0  # the estimate of vLLM's memory profiling capture
    _agreeing: bool = False  # inside dispatch_agreed's agreement
    # What each capture (its warm-up and recorded forwards) runs inside; host mode's
    # runner sets it (``host/runner_v2.py``).
    around_capture: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    _create_forward_fn: CreateForwardFn | None = None

    def set_up_graphs(
        self,
        name: str,
        expected_tasks: int | None,
        role: str = MODEL,
        task_label: str = "attention",
    ) -> None:
        """Capture into a :class:`FullGraphs` named ``name`` of the platform's graph
        backend, in vLLM's pool, each graph recording ``expected_tasks`` attention tasks
        (``None``: unchecked); ``role``: whose counters it counts in."""
        self.full = FullGraphs(
            _run_forward,
            name=name,
            expected_tasks=expected_tasks,
            role=role,
            pool=self.pool,
            task_label=task_label,
        )

    def capture(
        self, create_forward_fn: CreateForwardFn, progress_bar_desc: str = "Capturing graphs"
    ) -> None:
        """Capture every descriptor of vLLM's plan, PIECEWISE first, then FULL (largest
        first in each); with ``capture_on_first_use``, none (``dispatch`` captures them);
        under vLLM's memory profiling, a sample (:attr:`profiled_bytes` gets the
        estimate of all)."""
        if self.full is None:
            raise ValueError("capture(create_forward_fn) before the model's capture set up graphs")
        self._create_forward_fn = create_forward_fn
        if capture_mem_samples(self) is not None:
            self.profiled_bytes = self._profile(create_forward_fn)
        elif self.capture_on_first_use:
            logger.info(
                "The model's %d graph keys are captured at their first step (capture_on_first_use)",
                sum(len(descs) for descs in capture_descs(self).values()),
            )
        else:
            backend = self.full.backend
            for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
                capture_all(
                    capture_descs(self).get(mode, []),
                    lambda desc: self._capture_one(create_forward_fn, desc),
                    backend=backend,
                    desc=f"{progress_bar_desc} ({backend.name}, {mode.name})",
                )
        set_graphs_captured(self, True)

    def _profile(self, create_forward_fn: CreateForwardFn) -> int:
        """Capture the largest and smallest descriptor of each mode; return the bytes
        all of them would hold (each graph's own, fit on the samples, plus the pool)."""
        backend = self.full.backend
        own_total = 0
        _, pool_before = backend.memory_breakdown()
        for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            own_total += self.full.estimate_bytes(
                capture_descs(self).get(mode, []),
                lambda desc: self._capture_one(create_forward_fn, desc),
            )
        _, pool_after = backend.memory_breakdown()
        return own_total + max(pool_after - pool_before, 0)

    def _capture_one(
        self, create_forward_fn: CreateForwardFn, desc: Any, at_first_use: bool = False
    ) -> None:
        with self.around_capture():
            self._warm_up_and_capture(create_forward_fn, desc, at_first_use)

    def _warm_up_and_capture(
        self, create_forward_fn: CreateForwardFn, desc: Any, at_first_use: bool
    ) -> None:
        warmup = create_forward_fn(desc, warmup=True)
        warmup(CUDAGraphMode.NONE)  # also allocates the persistent outputs, outside graphs
        if desc.cg_mode == CUDAGraphMode.PIECEWISE:
            warmup(CUDAGraphMode.PIECEWISE)  # the compiled model's pieces capture themselves
            return
        if desc.num_ubatches > 1:  # a split step: one graph of its micro-batches
            with self.ubatch_runner.capturing(desc):
                create_forward_fn(desc, warmup=False)(CUDAGraphMode.NONE)
            self.graphs[desc] = self.ubatch_runner.graph_key(desc)
            return
        self.full.capture(desc, create_forward_fn(desc, warmup=False), at_first_use=at_first_use)
        self.graphs[desc] = self.full.entry(desc)

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        *args: Any,
        **kwargs: Any,
    ) -> BatchExecutionDescriptor:
        """vLLM's descriptor for the step (``CudaGraphManager.dispatch``'s arguments); a
        FULL one not captured yet is captured now (``capture_on_first_use``); a step
        without graphs is counted."""
        desc = super().dispatch(num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
        if graphs_captured(self) and not self._agreeing:
            self._dispatched(desc, num_tokens, uniform_token_count)
        return desc

    def dispatch_agreed(
        self,
        agree: Callable[[], tuple[BatchExecutionDescriptor, Any]],
        num_tokens: int,
        uniform_token_count: int | None,
    ) -> tuple[BatchExecutionDescriptor, Any]:
        """vLLM's dispatch agreed across data-parallel ranks (``agree()``: its
        ``dispatch_cg_and_sync_dp``, whose result it returns). The dispatches inside it
        are wishes (each rank's own, then the ones ranks may drop); only the descriptor
        agreed on is captured at first use or counted, after the agreement, on every
        rank alike: a capture runs the model's collectives, which must pair up."""
        self._agreeing = True
        try:
            desc, sync = agree()
        finally:
            self._agreeing = False
        if graphs_captured(self):
            self._dispatched(desc, num_tokens, uniform_token_count)
        return desc, sync

    def _dispatched(
        self, desc: BatchExecutionDescriptor, num_tokens: int, uniform_token_count: int | None
    ) -> None:
        if desc.cg_mode == CUDAGraphMode.FULL and desc not in self.graphs:
            self._capture_at_first_use(desc)
        else:
            self._count_dispatch(desc, num_tokens, uniform_token_count)

    def _capture_at_first_use(self, desc: BatchExecutionDescriptor) -> None:
        if self._create_forward_fn is None:
            raise ValueError(f"FULL graph {desc} dispatched before the model's capture")
        with torch.inference_mode():
            self._capture_one(self._create_forward_fn, desc, at_first_use=True)

    def run_fullgraph(self, desc: BatchExecutionDescriptor) -> None:
        """Replay ``desc``'s graph with its attention tasks brought to the step's
        metadata (``FullGraphs.replay``: the order is the graph backend's).

        Raises:
            ValueError: no step metadata was left since the last replay.
        """
        attn_metadata, self.step_attn_metadata = self.step_attn_metadata, None
        if desc.num_ubatches > 1:
            self._replay_micro_batches(desc)
            return
        if attn_metadata is None:
            raise ValueError(
                f"FULL graph replay of {desc} without the step's attention metadata: "
                "the model state's prepare_attn did not run for this step"
            )
        self.full.replay(desc, attn_metadata)

    def _replay_micro_batches(self, desc: BatchExecutionDescriptor) -> None:
        """Replay the graph of the step's micro-batches (each its tasks brought to its
        own plan, by the micro-batch runner) into the persistent outputs vLLM reads."""
        if self.hidden_states is None or not self.is_last_pp_rank:
            raise ValueError(
                f"micro-batched FULL graph {desc}: the persistent hidden states of the last "
                "pipeline stage expected (vLLM micro-batches no other)"
            )
        outputs = self.ubatch_runner.replay(desc)
        self.hidden_states[: desc.num_tokens].copy_(outputs)

    def _count_dispatch(
        self, desc: BatchExecutionDescriptor, num_tokens: int, uniform_token_count: int | None
    ) -> None:
        """A dispatch to ``desc`` that is not a FULL graph (a step without graphs is
        counted, a decode step off the grid logged once)."""
        if desc.cg_mode == CUDAGraphMode.NONE:
            count_eager_step(
                self.full.counters,
                num_tokens,
                self.vllm_config.compilation_config.max_cudagraph_capture_size,
                lambda: uniform_token_count is not None,
            )


class BridgeModelGraphManager(ModelCudaGraphManager, NpuGraphsCapture):
    """vLLM's ``ModelCudaGraphManager`` whose graphs are npu-graphs graphs."""

    def capture(self, model: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM's model capture (``ModelCudaGraphManager.capture``'s arguments) into a
        ``GraphWrapper`` of the platform's graph backend; each FULL graph must record
        one attention task per attention layer of ``model``."""
        if self.use_breakable_cg:
            raise NotImplementedError(
                "VLLM_USE_BREAKABLE_CUDAGRAPH: breakable CUDA graphs are torch.cuda graphs; "
                "the bridge captures PIECEWISE graphs through vLLM's compiled pieces"
            )
        self.set_up_graphs(
            f"{type(model).__name__}[FULL]", count_attention_tasks(self.vllm_config, model)
        )
        self.capture_on_first_use = current_settings().capture_on_first_use
        super().capture(model, *args, **kwargs)


def _run_forward(forward_fn: Any) -> None:
    """What a FULL graph records: vLLM's capture forward (inputs and outputs in the
    manager's persistent buffers)."""
    forward_fn(CUDAGraphMode.NONE)
