"""Graph counters: what was captured, replayed and updated, and how micro-batched (DBO)
steps ran. Nothing here is process-wide: every count lives in an object its owner holds.

* Each graph component owns a :class:`GraphCounters` (its ``counters``) and counts into
  it: ``FullGraphs`` its captures, replays and task updates (a drafter's, role
  ``DRAFTER``, into the ``draft_*`` fields, its captures also in ``captured``); V1's
  ``BridgeGraphWrapper`` its PIECEWISE captures and piece replays and, for the wrapper
  that counts a model's steps, the steps run without graphs; V2's graph managers their
  dispatches without graphs, into their ``FullGraphs``' (a drafter's into
  ``draft_other_forwards``); the micro-batch wrappers their split steps and
  micro-batched graphs.
* The model runner owns one too, for what its start-up counts (capture time and bytes,
  the graph-memory estimate, ``serving``), and answers ``graph_counters()``: the sum
  (:func:`sum_counters`) of its own and its components', a fresh object each call
  (:class:`RunnerCounters`). Tests reach it through the worker
  (``llm.collective_rpc(lambda worker: worker.model_runner.graph_counters())``).
* The worker writes its runner's sum after each step where ``NPU_BRIDGE_COUNTERS_DIR``
  asks (:func:`write_counters_where_asked`): how a server's worker processes report.

A new component holds ``self.counters = GraphCounters()``, counts into it, and is found
by its runner's ``graph_component_counters()`` (``graphs/runner.py`` for V1,
``graphs/v2_runner.py`` for Model Runner V2; a wrapper handed to
``graphs/wrapper.py``'s ``track_wrapper`` is found by both).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

# The counts of model forwards, zeroed after start-up (warm-up forwards are not steps).
STEP_FIELDS = (
    "eager_steps",
    "off_grid_steps",
    "draft_other_forwards",
    "split_steps",
    "split_decode_steps",
    "split_prefill_steps",
    "split_unequal_steps",
    "split_forwards_run",
    "split_yields",
)


@dataclass
class GraphCounters:
    """Counts of one owner (a graph component, or a runner's sum) since start-up.

    Attributes:
        captured: graphs captured (one per FULL key, one per piece and PIECEWISE key).
        replayed_steps: model forwards served by replaying a FULL graph.
        piecewise_steps: model forwards served by replaying PIECEWISE graphs (the
            pieces between attention layers; attention runs eagerly between them).
        replayed_pieces: PIECEWISE piece replays.
        task_updates: FULL replays preceded by a re-issue of the attention tasks
            with the step's plan.
        eager_steps: model forwards that ran without a graph (a size with no graph,
            a mixed batch under FULL_DECODE_ONLY); only counted with graphs on.
        off_grid_steps: those of them that were decode steps larger than the largest
            graph size (the first one after start-up is logged).
        capture_bytes: memory the captured graphs hold (backend's own accounting:
            what each graph keeps plus the pool their replays share): a runner's
            start-up captures, or after a capture at first use the backend's whole
            memory in use (shared by every component: a sum takes the largest).
        estimated_bytes: the graph memory estimated before the KV cache was sized (the
            runner's).
        capture_seconds: wall time of the captures (at start-up, or at first use).
        draft_captured: FULL graphs of the drafter's own forwards captured (also in
            ``captured``).
        draft_replayed_steps: drafter forwards served by replaying its FULL graphs.
        draft_task_updates: drafter FULL replays preceded by an update of the
            drafter's own task registry.
        draft_other_forwards: drafter forwards that ran PIECEWISE or eagerly.
        split_steps: model forwards vLLM split into micro-batches (DBO; also counted in
            ``replayed_steps`` or ``eager_steps`` as they ran).
        split_decode_steps: those whose micro-batches held decodes only.
        split_prefill_steps: those with a prefill (or a chunk of one) in a micro-batch.
        split_unequal_steps: those whose micro-batches hold different token counts.
        split_captured: micro-batched FULL graphs captured, both micro-batches in one
            graph per batch size and split (also in ``captured``).
        split_replayed_steps: split steps served by replaying a micro-batched graph.
        split_task_updates: those replays preceded by the update of each micro-batch's
            attention tasks with its own plan.
        split_forwards_run: split forwards whose micro-batches ran in Python threads:
            eager split steps, and the runs of a capture (warm-up included). A replay
            runs the captured interleaving without them.
        split_yields: hand-overs from one micro-batch to the other (at each MoE
            dispatch and combine) in those forwards.
    """

    captured: int = 0
    replayed_steps: int = 0
    piecewise_steps: int = 0
    replayed_pieces: int = 0
    task_updates: int = 0
    eager_steps: int = 0
    off_grid_steps: int = 0
    capture_bytes: int = 0
    estimated_bytes: int = 0
    capture_seconds: float = 0.0
    draft_captured: int = 0
    draft_replayed_steps: int = 0
    draft_task_updates: int = 0
    draft_other_forwards: int = 0
    split_steps: int = 0
    split_decode_steps: int = 0
    split_prefill_steps: int = 0
    split_unequal_steps: int = 0
    split_captured: int = 0
    split_replayed_steps: int = 0
    split_task_updates: int = 0
    split_forwards_run: int = 0
    split_yields: int = 0
    serving: bool = False  # start-up (profiling, capture) is over (a sum: any part's)

    @property
    def yields_per_split_forward(self) -> float:
        """Mean hand-overs per split forward run in Python (0 when none ran)."""
        return self.split_yields / self.split_forwards_run if self.split_forwards_run else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "yields_per_split_forward": self.yields_per_split_forward}

    def forget_warm_up(self) -> None:
        """Zero the counts of model forwards (:data:`STEP_FIELDS`): a start-up's warm-up
        forwards are not steps."""
        for name in STEP_FIELDS:
            setattr(self, name, 0)

    def reset(self) -> None:
        """Zero every count (``serving`` included)."""
        for field in fields(self):
            setattr(self, field.name, field.default)

    def describe_micro_batching(self) -> str:
        """One line on the micro-batched steps, beside the graph counters."""
        return (
            f"Micro-batched steps: {self.split_steps} split ({self.split_decode_steps} decode, "
            f"{self.split_prefill_steps} with a prefill), {self.split_replayed_steps} replayed "
            f"one graph of both micro-batches ({self.split_captured} such graphs captured, "
            f"{self.split_task_updates} per-micro-batch task updates), "
            f"{self.yields_per_split_forward:.1f} hand-overs per split forward run in Python."
        )


def sum_counters(parts: Iterable[GraphCounters]) -> GraphCounters:
    """A new :class:`GraphCounters` holding the sum of ``parts`` (an owner's and its
    components'): counts add up, ``capture_bytes`` is the largest (a capture at first
    use records the backend's whole memory in use), ``serving`` is any part's.

    Raises:
        TypeError: a part is no :class:`GraphCounters`.
    """
    total = GraphCounters()
    for part in parts:
        if not isinstance(part, GraphCounters):
            raise TypeError(f"sum_counters takes GraphCounters, got {type(part).__name__}")
        for field in fields(GraphCounters):
            name = field.name
            mine, theirs = getattr(total, name), getattr(part, name)
            if name == "capture_bytes":
                value = max(mine, theirs)
            elif name == "serving":
                value = mine or theirs
            else:
                value = mine + theirs
            setattr(total, name, value)
    return total


class RunnerCounters:
    """Mixin of the bridge's model runners: what the runner counts itself
    (:attr:`runner_counters`: start-up capture time and bytes, the estimate,
    ``serving``) and :meth:`graph_counters`, that summed with its graph components'
    (:meth:`graph_component_counters`, each runner's to name)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.runner_counters = GraphCounters()
        super().__init__(*args, **kwargs)

    def graph_component_counters(self) -> list[GraphCounters]:
        """The counters of every graph component of this runner, each once."""
        raise NotImplementedError

    def graph_counters(self) -> GraphCounters:
        """This runner's graph counters: its own and its components' summed, a new
        object each call (:func:`sum_counters`)."""
        return sum_counters([self.runner_counters, *self.graph_component_counters()])

    def reset_graph_counters(self) -> None:
        """Zero this runner's counters and its components' (tests, benchmarks)."""
        for counters in (self.runner_counters, *self.graph_component_counters()):
            counters.reset()

    def start_serving(self) -> None:
        """Start-up is over: the warm-up forwards counted so far are forgotten
        (:meth:`GraphCounters.forget_warm_up`), and every part is ``serving`` (a
        decode step off the graph grid is logged from now on)."""
        for counters in (self.runner_counters, *self.graph_component_counters()):
            counters.forget_warm_up()
            counters.serving = True


def count_eager_step(
    counters: GraphCounters,
    num_tokens: int | None,
    largest: int | None,
    is_decode: Callable[[], bool],
) -> None:
    """Count in ``counters`` a model forward that ran without graphs; count a decode
    step larger than the largest graph size (``is_decode`` is asked only for those) as
    off the grid and log the first one after start-up (a prefill that large runs
    eagerly by design)."""
    counters.eager_steps += 1
    if num_tokens is None or largest is None or num_tokens <= largest or not is_decode():
        return
    counters.off_grid_steps += 1
    if counters.serving and counters.off_grid_steps == 1:
        logger.warning(
            "A decode step of %d tokens ran without graphs: the largest graph is for %d "
            "tokens; raise max_cudagraph_capture_size (or cudagraph_capture_sizes) to "
            "cover max_num_seqs x (1 + num_speculative_tokens). Further such steps are "
            "counted in the model runner's graph_counters().off_grid_steps, not logged.",
            num_tokens,
            largest,
        )


COUNTERS_DIR_ENV = "NPU_BRIDGE_COUNTERS_DIR"


def write_counters_where_asked(
    counters: Callable[[], GraphCounters], data_parallel_rank: int, rank: int
) -> None:
    """After a worker's step: write ``counters()`` (its model runner's
    ``graph_counters``, called only then) as JSON to ``dp<D>-rank<R>.json`` in the
    directory ``NPU_BRIDGE_COUNTERS_DIR`` names (nothing when it is unset), replacing
    the file whole, so a reader never sees half of it.

    A server's workers are processes of their own, and vLLM hands a utility call's
    answer back from the first data-parallel engine only; these files are how each
    rank's captures, replays and micro-batched steps reach a caller (the tests)."""
    directory = os.environ.get(COUNTERS_DIR_ENV)
    if not directory:
        return
    path = Path(directory) / f"dp{data_parallel_rank}-rank{rank}.json"
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(counters().as_dict()))
    os.replace(partial, path)
