"""Timing, bandwidth baselines and result output shared by the benchmarks.

Times are medians of CUDA-event timings (``triton.testing.do_bench``, which also
clears the L2 cache before every repetition); they are meaningful only on a GPU.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
for package in ("npu-attention", "npu-graphs"):
    src = str(ROOT / "packages" / package / "src")
    if src not in sys.path:
        sys.path.insert(0, src)


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (times are taken on the GPU machine)")
    return torch.device("cuda")


def median_ms(fn: Callable[[], Any], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median device time of ``fn`` in milliseconds (L2 flushed before each call)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def queued_median_ms(fn: Callable[[], Any], reps: int = 20, hold_ms: float = 10.0) -> float:
    """Median device time of ``fn`` with its launches queued ahead of the GPU, as when
    the host runs ahead of a model's layers: before each call the L2 cache is flushed
    and the stream held busy for about ``hold_ms`` (``torch.cuda._sleep``) while the
    host issues ``fn``, so that the timed span holds the device's work alone, back to
    back. For work a graph cannot capture; it must be issued within ``hold_ms``."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    cycles = _cycles(hold_ms)
    fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def host_issue_us(fn: Callable[[], Any], calls: int = 20, hold_ms: float = 50.0) -> float:
    """Host time to issue one call of ``fn`` (microseconds, the mean of ``calls``), the
    stream held busy meanwhile so that no launch waits for the device."""
    import time

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(_cycles(hold_ms))
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - begin
    torch.cuda.synchronize()
    return seconds / calls * 1e6


def _cycles(ms: float) -> int:
    """GPU clock cycles that last at least ``ms`` at clocks up to 2 GHz."""
    return int(ms * 2e6)


def interleaved_median_ms(
    fns: dict[str, Callable[[], Any]],
    rounds: int = 3,
    timer: Callable[[Callable[[], Any]], float] = median_ms,
) -> dict[str, tuple[float, float]]:
    """Each of ``fns`` timed by ``timer`` in ``rounds`` interleaved rounds (one timing
    of every function per round, so that clock and temperature drift reach them alike):
    its median over the rounds and the rounds' spread (max - min) in percent of it."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(timer(fn))
    result = {}
    for name, values in samples.items():
        middle = sorted(values)[len(values) // 2]
        result[name] = (middle, 100 * (max(values) - min(values)) / middle)
    return result


def kernel_names(fn: Callable[[], Any]) -> list[str]:
    """Names of the device kernels one call of ``fn`` launches (copies and fills left out)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        fn()
        torch.cuda.synchronize()
    names = []
    for event in profiler.events():
        skip = any(word in event.name.lower() for word in ("memset", "memcpy", "fill"))
        if event.device_type == torch.autograd.DeviceType.CUDA and not skip:
            names.append(event.name)
    return list(dict.fromkeys(names))


def graph_median_ms(fn: Callable[[], Any]) -> float:
    """Median device time of ``fn`` captured as a CUDA graph (no launch overhead)."""
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def graph_launch_floor_ms(device: torch.device) -> float:
    """Device time of replaying a graph of one tiny kernel: the floor under any graph timing."""
    counter = torch.zeros(1, device=device)
    return graph_median_ms(lambda: counter.add_(1))


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


SDPA_PEERS = ("default", "cudnn", "flash")


def sdpa_backend(name: str) -> Any:
    """A context manager that restricts SDPA to one backend (``default``: torch's choice)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    return contextlib.nullcontext() if name == "default" else sdpa_kernel(backends[name])


def peer_runner(name: str, fn: Callable[[], Any]) -> Callable[[], Any] | None:
    """``fn`` run under SDPA backend ``name``, or ``None`` when that backend refuses it."""

    def run() -> Any:
        with sdpa_backend(name):
            return fn()

    try:
        run()
        torch.cuda.synchronize()
    except (RuntimeError, ValueError, NotImplementedError):
        return None
    return run


def environment(device: torch.device) -> dict[str, Any]:
    import triton

    return {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def print_table(columns: list[str], rows: list[dict[str, Any]]) -> None:
    """Print ``rows`` (dicts) as an aligned text table of ``columns``."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    cells = [[cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``benchmarks/results/<name>.json`` and return the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path
