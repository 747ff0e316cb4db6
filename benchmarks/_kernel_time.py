"""Kernel-only device time: what a call costs without the launch floor of a graph replay.

Two measurements, both with cold K/V (none of the call's inputs in the L2 cache):
- ``profiled_kernel_us``: the durations of the call's kernels as the profiler (CUPTI)
  records them, summed per call, the L2 cache cleared before each call; the gaps
  between kernels and the launch are left out;
- ``amortized_graph_us``: one CUDA graph of many calls that cycle over several copies
  of the inputs (together larger than the L2 cache), replay time / calls: the launch
  floor of the graph is shared by all the calls, the gaps between kernels are in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import _timing
import torch

_FLUSH_BYTES = 256 << 20


def profiled_kernel_us(fn: Callable[[], Any], calls: int = 30) -> float:
    """Median over ``calls`` of the summed kernel durations of one ``fn()``."""
    flush = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(calls):
            flush.zero_()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    events = [
        e
        for e in profiler.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and _is_kernel(e.name)
    ]
    # Group kernels into calls: a flush kernel (a fill) starts each call.
    per_call: list[float] = []
    current = None
    for event in sorted(events, key=lambda e: e.time_range.start):
        if "fill" in event.name.lower() or "FillFunctor" in event.name:
            if current is not None:
                per_call.append(current)
            current = 0.0
            continue
        if current is not None:
            current += event.time_range.elapsed_us()
    if current is not None:
        per_call.append(current)
    per_call.sort()
    return per_call[len(per_call) // 2] if per_call else float("nan")


def _is_kernel(name: str) -> bool:
    lowered = name.lower()
    return not any(word in lowered for word in ("memcpy", "memset", "cudaevent", "sync"))


def amortized_graph_us(fns: Sequence[Callable[[], Any]], calls: int = 32) -> float:
    """Replay time of one graph of ``calls`` calls cycling over ``fns`` (each on its own
    copy of the inputs), per call."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    return _timing.median_ms(graph.replay) * 1e3 / calls
