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


def interleaved_median_ms(
    fns: dict[str, Callable[[], Any]], rounds: int = 3
) -> dict[str, tuple[float, float]]:
    """Each of ``fns`` timed in ``rounds`` interleaved rounds (one ``median_ms`` of every
    function per round, so that clock and temperature drift reach them alike): its
    median over the rounds and the rounds' spread (max - min) in percent of it."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(median_ms(fn))
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
