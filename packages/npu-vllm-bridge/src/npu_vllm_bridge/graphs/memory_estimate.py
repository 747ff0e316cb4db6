"""Graph memory before the KV cache is sized, from a sample of the sizes to capture.

Each graph keeps some memory for itself (its outputs), roughly linear in its token
count; the pool the replays share is as large as the largest replay's intermediates
and counts once. Capturing the largest and the smallest size of a group and fitting
``a + b * num_tokens`` estimates the group without capturing all of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from npu_graphs import GraphBackend


def sample_descs(descs: Sequence[Any]) -> list[Any]:
    """The largest and the smallest of ``descs`` (by ``num_tokens``), largest first; one
    when they are the same size."""
    largest = max(descs, key=lambda desc: desc.num_tokens)
    smallest = min(descs, key=lambda desc: desc.num_tokens)
    return [largest] if largest.num_tokens == smallest.num_tokens else [largest, smallest]


def fit_own_bytes(samples: Sequence[tuple[int, int]], sizes: Iterable[int]) -> int:
    """Sum over ``sizes`` of a graph's own bytes, linear between the samples.

    Args:
        samples: ``(num_tokens, own_bytes)`` of the captured sample graphs, one or two.
        sizes: the token count of every graph of the group, the samples' included.
    """
    (n_big, m_big), (n_small, m_small) = samples[0], samples[-1]
    slope = (m_big - m_small) / (n_big - n_small) if n_big != n_small else 0.0
    return int(sum(m_small + slope * (size - n_small) for size in sizes))


def estimate_own_bytes(
    backend: GraphBackend, descs: Sequence[Any], capture_one: Callable[[Any], None]
) -> int:
    """The bytes the graphs of ``descs`` (each with ``num_tokens``) keep for their own:
    ``capture_one(desc)`` captures the largest and the smallest, each graph's own bytes
    (``backend.memory_breakdown()``) are fit as ``a + b * num_tokens`` and summed over
    ``descs``. The pool the replays share is not included: it counts once, measured by
    the caller around every group."""
    if not descs:
        return 0
    samples = []
    for desc in sample_descs(descs):
        before, _ = backend.memory_breakdown()
        capture_one(desc)
        after, _ = backend.memory_breakdown()
        samples.append((desc.num_tokens, after - before))
    return fit_own_bytes(samples, [desc.num_tokens for desc in descs])
