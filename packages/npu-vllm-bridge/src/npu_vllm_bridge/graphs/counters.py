"""Process-wide graph counters: what was captured, replayed and updated."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class GraphCounters:
    """Counts since start-up (or the last :func:`reset_graph_counters`).

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
            what each graph keeps plus the pool their replays share).
        estimated_bytes: the graph memory estimated before the KV cache was sized.
        capture_seconds: wall time of the captures (at start-up, or at first use).
        draft_captured: FULL graphs of the drafter's own forwards captured (also in
            ``captured``).
        draft_replayed_steps: drafter forwards served by replaying its FULL graphs.
        draft_task_updates: drafter FULL replays preceded by an update of the
            drafter's own task registry.
        draft_other_forwards: drafter forwards that ran PIECEWISE or eagerly.
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
    serving: bool = False  # start-up (profiling, capture) is over

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


_COUNTERS = GraphCounters()


def graph_counters() -> GraphCounters:
    """The live counters of this process."""
    return _COUNTERS


def reset_graph_counters() -> None:
    """Zero every counter (tests and benchmarks)."""
    global _COUNTERS
    for name, value in GraphCounters().as_dict().items():
        setattr(_COUNTERS, name, value)
