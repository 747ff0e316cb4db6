"""Capture planning: which batch sizes get a graph, and how a batch is padded to one.

::

    plan = plan_capture(max_size=512, tp_size=2, num_speculative_tokens=1,
                        max_num_reqs=64, max_graphs=backend.max_graphs(num_layers))
    plan.padded_size(37)                 # -> 40: the smallest captured size that fits
    plan.padded_uniform_decode_size(6)   # -> 6: decode batches of 3 requests x 2 tokens
    for size in plan.capture_order(): ...   # largest first
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Streams an Ascend device offers to captured graphs; a graph of an L-layer model
# holds about L + 1 of them.
NPU_STREAM_BUDGET = 2048


def graphs_within_stream_budget(num_layers: int, stream_budget: int = NPU_STREAM_BUDGET) -> int:
    """How many graphs of a ``num_layers`` model fit ``stream_budget`` streams (L + 1 each)."""
    _check_int("num_layers", num_layers, minimum=0)
    _check_int("stream_budget", stream_budget, minimum=1)
    return stream_budget // (num_layers + 1)


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default sizes: 1, 2, 4, then steps of 8 below 256 and of 16 from 256, up to
    ``max_size`` (which is included even when off the grid)."""
    _check_int("max_size", max_size, minimum=1)
    grid = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    sizes = [s for s in grid if s <= max_size]
    return sizes if sizes[-1] == max_size else [*sizes, max_size]


@dataclass(frozen=True)
class CapturePlan:
    """Graph sizes for mixed batches and for uniform decode batches, and their padding.

    Attributes:
        sizes: token counts of the mixed-batch graphs, ascending.
        uniform_decode_sizes: token counts of the uniform-decode graphs, ascending
            (multiples of ``uniform_decode_query_len``).
        uniform_decode_query_len: tokens per request in a uniform decode batch
            (1 + speculative tokens).
        dropped: sizes asked for but left out to fit the device's graph budget.
    """

    sizes: tuple[int, ...]
    uniform_decode_sizes: tuple[int, ...] = ()
    uniform_decode_query_len: int = 1
    dropped: tuple[int, ...] = ()

    @property
    def max_size(self) -> int:
        """The largest mixed-batch graph size."""
        return self.sizes[-1]

    @property
    def num_graphs(self) -> int:
        return len(self.sizes) + len(self.uniform_decode_sizes)

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest mixed-batch graph size >= ``num_tokens``; None if none fits (run eager)."""
        return _pad(self.sizes, num_tokens)

    def padded_uniform_decode_size(self, num_tokens: int) -> int | None:
        """The smallest uniform-decode graph size >= ``num_tokens``; None if none fits."""
        return _pad(self.uniform_decode_sizes, num_tokens)

    def padding_table(self) -> list[int]:
        """``table[n]`` = padded size of an ``n``-token batch, for ``n`` in 0..max_size."""
        table, index = [], 0
        for n in range(self.max_size + 1):
            while self.sizes[index] < n:
                index += 1
            table.append(self.sizes[index])
        return table

    def capture_order(self, uniform_decode: bool = False) -> list[int]:
        """Sizes to capture, largest first (later, smaller graphs reuse the pool's memory)."""
        sizes = self.uniform_decode_sizes if uniform_decode else self.sizes
        return sorted(sizes, reverse=True)


def plan_capture(
    sizes: Sequence[int] | None = None,
    *,
    max_size: int | None = None,
    tp_size: int = 1,
    num_speculative_tokens: int = 0,
    max_num_reqs: int | None = None,
    max_graphs: int | None = None,
) -> CapturePlan:
    """Plan the graphs to capture.

    Args:
        sizes: token counts to capture; default :func:`default_capture_sizes` of ``max_size``.
            With both given, sizes above ``max_size`` are dropped.
        max_size: the largest token count to capture.
        tp_size: tensor-parallel size; only multiples of it are kept (sequence parallelism
            splits tokens evenly over the ranks).
        num_speculative_tokens: uniform decode batches have ``1 + num_speculative_tokens``
            tokens per request; their graph sizes are the planned sizes rounded up to
            multiples of that (and of ``tp_size``), at most ``max_num_reqs`` requests.
        max_num_reqs: most requests per batch; None: no uniform-decode graphs.
        max_graphs: how many graphs the device can hold (e.g. ``backend.max_graphs(layers)``
            on NPU); when more are asked for, an evenly spread subset is kept (the smallest
            and largest sizes always) and one log line says so.

    Raises:
        TypeError: a count that is not an int.
        ValueError: neither ``sizes`` nor ``max_size``, counts < 1, or nothing left to capture.
    """
    _check_int("tp_size", tp_size, minimum=1)
    _check_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
    if max_num_reqs is not None:
        _check_int("max_num_reqs", max_num_reqs, minimum=1)
    if max_graphs is not None:
        _check_int("max_graphs", max_graphs, minimum=1)
    mixed = _requested_sizes(sizes, max_size)
    if tp_size > 1:
        mixed = [s for s in mixed if s % tp_size == 0]
        if not mixed:
            raise ValueError(f"no capture size is a multiple of tp_size={tp_size}")
    query_len = 1 + num_speculative_tokens
    uniform = _uniform_decode_sizes(mixed, query_len, tp_size, max_num_reqs)
    kept_mixed, kept_uniform = _fit_budget(mixed, uniform, max_graphs)
    dropped = tuple(sorted(set(mixed) - set(kept_mixed)))
    if max_graphs is not None and len(mixed) + len(uniform) > max_graphs:
        logger.warning(
            "%d graphs asked for, the device holds %d: capturing sizes %s and uniform-decode "
            "sizes %s, the rest run eagerly or padded to a larger size",
            len(mixed) + len(uniform),
            max_graphs,
            kept_mixed,
            kept_uniform,
        )
    return CapturePlan(tuple(kept_mixed), tuple(kept_uniform), query_len, dropped)


def _requested_sizes(sizes: Sequence[int] | None, max_size: int | None) -> list[int]:
    if max_size is not None:
        _check_int("max_size", max_size, minimum=1)
    if sizes is None:
        if max_size is None:
            raise ValueError("give capture sizes or a max_size")
        return default_capture_sizes(max_size)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"sizes must be a sequence of ints, got {type(sizes).__name__}")
    for size in sizes:
        _check_int("capture size", size, minimum=1)
    kept = sorted({s for s in sizes if max_size is None or s <= max_size})
    if not kept:
        raise ValueError(f"no capture size left from {list(sizes)} with max_size={max_size}")
    return kept


def _uniform_decode_sizes(
    mixed: list[int], query_len: int, tp_size: int, max_num_reqs: int | None
) -> list[int]:
    if max_num_reqs is None:
        return []
    step = math.lcm(query_len, tp_size)
    limit = max_num_reqs * query_len
    rounded = {step * math.ceil(s / step) for s in mixed}
    return sorted(s for s in rounded if s <= limit)


def _fit_budget(
    mixed: list[int], uniform: list[int], max_graphs: int | None
) -> tuple[list[int], list[int]]:
    total = len(mixed) + len(uniform)
    if max_graphs is None or total <= max_graphs:
        return mixed, uniform
    keep_uniform = min(len(uniform), round(max_graphs * len(uniform) / total))
    keep_mixed = max(1, max_graphs - keep_uniform)
    keep_uniform = max_graphs - keep_mixed
    return _spread(mixed, keep_mixed), _spread(uniform, keep_uniform)


def _spread(values: list[int], count: int) -> list[int]:
    """``count`` values evenly spread over sorted ``values``, both ends included."""
    if count >= len(values):
        return list(values)
    if count <= 0:
        return []
    if count == 1:
        return [values[-1]]
    step = (len(values) - 1) / (count - 1)
    return sorted({values[round(i * step)] for i in range(count)})


def _pad(sizes: tuple[int, ...], num_tokens: int) -> int | None:
    _check_int("num_tokens", num_tokens, minimum=1)
    index = bisect.bisect_left(sizes, num_tokens)
    return sizes[index] if index < len(sizes) else None


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
