"""Micro-batch overlap (vLLM's DBO) on Model Runner V2, in the place of its ``UBatchRunner``.

With ``--enable-dbo`` (and ``VLLM_USE_V2_MODEL_RUNNER=1``, which vLLM asks for), vLLM's
V2 ``GPUModelRunner`` builds a ``UBatchRunner`` (``vllm/v1/worker/gpu/ubatch_utils.py``)
and, for a step its DP ranks agree to split, asks it to ``prepare`` the micro-batches
(the split, one sub-batch and attention metadata per micro-batch, one forward context
each) and to ``run`` them; a FULL descriptor of a split step (``num_ubatches`` > 1) is
captured through ``begin_capturable_run`` and replayed by the graph manager. vLLM's
runner is CUDA's: CUDA streams and events, SM control, its ``dbo_yield`` hand-overs.

:class:`BridgeUBatchRunner` keeps vLLM's ``prepare`` as it is and runs the micro-batches
on the bridge's :class:`~npu_vllm_bridge.graphs.ubatch_wrapper.SplitForwards` (as V1's
micro-batch wrapper does): npu-graphs' ``MicroBatchRunner`` threads on the graph
backend's streams, handing over at the MoE dispatch and combine
(``micro_batch_collective``), and one graph of all micro-batches per descriptor and
split, each micro-batch's attention tasks brought to its own plan at every replay.

* eager split steps: ``run``;
* capture: the graph manager (``graphs/v2_graphs.py``) runs vLLM's capture forward of
  a split descriptor inside :meth:`BridgeUBatchRunner.capturing`, so the run the
  forward finishes is captured (vLLM's warm-up run before it is eager);
* replay: the manager's ``run_fullgraph`` calls :meth:`BridgeUBatchRunner.replay` with
  the micro-batches the step's ``prepare`` left.

The model runners build it where vLLM builds its own (``graphs/v2_runner.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner, UBatchState

from npu_vllm_bridge.attention.tasks import count_attention_tasks
from npu_vllm_bridge.graphs.ubatch_wrapper import SplitForwards
from npu_vllm_bridge.graphs.wrapper import track_wrapper
from npu_vllm_bridge.vllm_seam import v2_ubatch_runner_buffers


class BridgeUBatchRunner(UBatchRunner):
    """vLLM's V2 ``UBatchRunner`` whose micro-batches run on npu-graphs' micro-batch runner.

    Takes vLLM's constructor arguments; builds vLLM's per-micro-batch buffers that
    ``prepare`` slices into, not its CUDA streams, barrier and SM control
    (``vllm_seam.V2_UBATCH_RUNNER_CUDA_ATTRIBUTES``).

    Attributes:
        split: the split steps' runs and graphs.
        counters: what ``split`` counted.
        prepared: the micro-batches of the last ``prepare`` (the step's).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        model_state: Any,
        attn_groups: list,
        kv_cache_config: Any,
        max_num_reqs: int,
    ) -> None:
        v2_ubatch_runner_buffers(
            self, vllm_config, device, model_state, attn_groups, kv_cache_config, max_num_reqs
        )
        model = model_state.model
        self.split = SplitForwards(
            vllm_config, count_attention_tasks(vllm_config, model), name=type(model).__name__
        )
        self.counters = self.split.counters
        self.prepared: UBatchState | None = None
        self._capture_key: Any = None
        track_wrapper(self)

    # -- vLLM's UBatchRunner --------------------------------------------------------------
    def prepare(self, *args: Any, **kwargs: Any) -> UBatchState:
        """vLLM's (``UBatchRunner.prepare``'s arguments); the state is kept for a replay."""
        self.prepared = super().prepare(*args, **kwargs)
        return self.prepared

    def run(self, model: Any, model_inputs: dict[str, Any], ubatch_state: UBatchState) -> Any:
        """An eager split step: each micro-batch on its thread."""
        contexts = ubatch_state.forward_contexts
        self.split.count_step(_splits(ubatch_state), contexts)
        return self.split.forward(model, ubatch_state.slices, contexts, model_inputs)

    def begin_capturable_run(
        self,
        model: Any,
        model_inputs: dict[str, Any],
        ubatch_state: UBatchState,
        for_capture: bool = False,
    ) -> Callable[[], Any]:
        """vLLM's capture forward of a split descriptor: the returned callable runs the
        micro-batches, captured as one graph inside :meth:`capturing`, else eagerly."""
        key = self._capture_key

        def finish() -> Any:
            return self.split.forward(
                model, ubatch_state.slices, ubatch_state.forward_contexts, model_inputs, key
            )

        return finish

    def abort_pending_run(self) -> None:
        """Nothing waits: the micro-batch threads start and end inside one run."""

    # -- the bridge's graph manager ---------------------------------------------------------
    @contextlib.contextmanager
    def capturing(self, key: Any) -> Iterator[None]:
        """Runs vLLM's capture forwards started in the block capture one graph of all
        micro-batches under ``key`` (a split descriptor)."""
        self._capture_key = key
        try:
            yield
        finally:
            self._capture_key = None

    def graph_key(self, key: Any) -> Any:
        """The key of ``key``'s graph of the last prepared split."""
        return self.split.runner.graph_key(key, _splits(self._prepared()))

    def replay(self, key: Any) -> Any:
        """Replay the graph of the step's micro-batches under ``key`` (a split
        descriptor), each micro-batch's attention tasks brought to its own plan; returns
        the model's outputs (one row per token of the padded step)."""
        state = self._prepared()
        self.prepared = None
        contexts = state.forward_contexts
        splits = _splits(state)
        self.split.count_step(splits, contexts)
        return self.split.replay(key, splits, [context.attn_metadata for context in contexts])

    def _prepared(self) -> UBatchState:
        if self.prepared is None:
            raise ValueError(
                "a micro-batched FULL graph needs the step's micro-batches, but vLLM's "
                "UBatchRunner.prepare did not run for this step"
            )
        return self.prepared

    # -- bookkeeping ----------------------------------------------------------------------
    def clear_graphs(self) -> None:
        self.split.clear()


def _splits(state: UBatchState) -> tuple[int, ...]:
    return tuple(int(piece.num_tokens) for piece in state.slices)
