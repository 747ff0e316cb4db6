"""Graph replay vs eager per step, task-update host time, capture time and memory.

Model: a stack of small layers, each ``x = x + mix(tanh(x @ W))`` where ``mix`` is
an attention-like updatable task (each token averages its own request's tokens up
to itself) that takes the per-step request lengths as step arguments (host lists on
backends with task update, a device tensor kept in a fixed buffer on CUDA). For
every token count from 1 to 256 it measures, in the same run:

* eager: one step run eagerly (the baseline);
* graph: one step as ``TaskRegistry.update`` + replay (steps alternate between two
  different request splits, so every update really changes the tasks);
* update: host time of ``TaskRegistry.update`` alone (once per step, all layers);
* capture: time and device memory of capturing that size (largest first, one pool).

Per-step times are wall-clock means over ``--steps`` steps with the device
synchronized before and after (host launch cost included, as a serving loop sees
it). Times are meaningful on the GPU machine only; with the host backend (CPU, no
GPU) the run is a smoke check and its figures are ratios at most.

    python benchmarks/bench_graphs.py [--backend cuda|host] [--layers 32] [--quick]
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import _timing  # first: puts the packages' src on sys.path
import torch

from npu_graphs import (
    GraphWrapper,
    RuntimeMode,
    TaskRegistry,
    get_backend,
    graph_dispatch,
    plan_capture,
)

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_REQS = 16


def mix(hidden: torch.Tensor, *, seq_lens: Any) -> torch.Tensor:
    """[tokens, dim] -> [tokens, dim]: causal mean over each request's own tokens."""
    lens = torch.as_tensor(seq_lens, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    token = torch.arange(hidden.shape[0], device=hidden.device)
    member = (token[:, None] >= (ends - lens)[None, :]) & (token[:, None] < ends[None, :])
    owner = member.to(hidden.dtype).argmax(1)
    weights = ((owner[:, None] == owner[None, :]) & (token[None, :] <= token[:, None])).to(
        hidden.dtype
    )
    return (weights @ hidden) / weights.sum(1, keepdim=True).clamp(min=1)


class Stack:
    def __init__(self, layers: int, hidden: int, device: torch.device, registry: TaskRegistry):
        generator = torch.Generator().manual_seed(0)
        self.weights = [
            (torch.randn(hidden, hidden, generator=generator) / hidden**0.5).to(device)
            for _ in range(layers)
        ]
        self.registry = registry

    def __call__(self, x: torch.Tensor, step: dict) -> torch.Tensor:
        for weight in self.weights:
            x = x + self.registry.call(mix, torch.tanh(x @ weight), step=step)
        return x


def make_step(backend, num_tokens: int, variant: int, device: torch.device) -> dict:
    """Request lengths splitting ``num_tokens`` evenly; variant 1 uses one request fewer."""
    requests = max(1, min(num_tokens, MAX_REQS) - variant)
    lens = [num_tokens // requests + (i < num_tokens % requests) for i in range(requests)]
    lens += [0] * (MAX_REQS - requests)
    if backend.supports_task_update:
        return {"seq_lens": lens}
    return {"seq_lens": torch.tensor(lens, device=device)}


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def timed(backend, fn, steps: int) -> float:
    """Mean wall-clock seconds per call, device synchronized around the loop."""
    backend.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        fn(i)
    backend.synchronize()
    return (time.perf_counter() - start) / steps


def bench(args: argparse.Namespace) -> dict[str, Any]:
    backend = get_backend(args.backend)
    device = torch.device("cuda" if backend.name == "cuda" else "cpu")
    registry = TaskRegistry("bench", expected_tasks=args.layers)
    model = Stack(args.layers, args.hidden, device, registry)
    wrapper = GraphWrapper(model, backend=backend, tasks=registry, name="stack")
    plan = plan_capture(list(args.sizes))
    static = torch.randn(plan.max_size, args.hidden, device=device)
    steps = {n: [make_step(backend, n, s, device) for s in (0, 1)] for n in plan.sizes}

    capture = {}
    for n in plan.capture_order():  # largest first, one shared pool
        # device tensors given at capture become the graph's fixed buffers: use copies
        capture_step = {k: _copy(v) for k, v in steps[n][0].items()}
        backend.synchronize()
        before, start = backend.memory_in_use(), time.perf_counter()
        with graph_dispatch(RuntimeMode.FULL, n):
            wrapper(static[:n], capture_step)
        backend.synchronize()
        capture[n] = (time.perf_counter() - start, backend.memory_in_use() - before)

    rows = []
    for n in plan.sizes:
        x = static[:n]

        def eager(i, n=n, x=x):
            model(x, steps[n][i % 2])

        def replay(i, n=n, x=x):
            registry.update(n, steps[n][i % 2])
            with graph_dispatch(RuntimeMode.FULL, n):
                wrapper(x, None)

        timed(backend, eager, args.warmup)
        eager_s = timed(backend, eager, args.steps)
        timed(backend, replay, args.warmup)
        graph_s = timed(backend, replay, args.steps)
        update_s = _update_host_time(backend, registry, n, steps[n], args.steps)
        seconds, nbytes = capture[n]
        rows.append(
            {
                "tokens": n,
                "eager_us": eager_s * 1e6,
                "graph_us": graph_s * 1e6,
                "speedup": eager_s / graph_s,
                "update_us": update_s * 1e6,
                "capture_ms": seconds * 1e3,
                "capture_mib": nbytes / 2**20,
            }
        )
        _check_equal(wrapper, model, x, steps[n][1], registry, n)
    return {"rows": rows, "backend": backend.name, "device": _device_name(device)}


def _update_host_time(backend, registry, n, step_pair, steps) -> float:
    registry.update(n, step_pair[1])
    total = 0.0
    for i in range(steps):
        start = time.perf_counter()
        registry.update(n, step_pair[i % 2])
        total += time.perf_counter() - start
    backend.synchronize()
    return total / steps


def _check_equal(wrapper, model, x, step, registry, n) -> None:
    registry.update(n, step)
    with graph_dispatch(RuntimeMode.FULL, n):
        graphed = wrapper(x, None).clone()
    torch.testing.assert_close(graphed, model(x, step), rtol=1e-4, atol=1e-4)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="cuda or host (default: by machine)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--sizes", type=lambda s: tuple(int(v) for v in s.split(",")), default=SIZES
    )
    parser.add_argument("--quick", action="store_true", help="4 layers, 3 sizes, 5 steps")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.sizes, args.steps, args.warmup = 4, (1, 16, 64), 5, 1
    result = bench(args)
    columns = [
        "tokens",
        "eager_us",
        "graph_us",
        "speedup",
        "update_us",
        "capture_ms",
        "capture_mib",
    ]
    print(
        f"backend={result['backend']} device={result['device']} layers={args.layers} "
        f"hidden={args.hidden} steps={args.steps}"
    )
    _timing.print_table(columns, result["rows"])
    payload = {
        "benchmark": "bench_graphs",
        "backend": result["backend"],
        "environment": {
            "device": result["device"],
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "config": {
            "layers": args.layers,
            "hidden": args.hidden,
            "steps": args.steps,
            "sizes": list(args.sizes),
            "max_reqs": MAX_REQS,
        },
        "rows": result["rows"],
    }
    _timing.write_json(f"bench_graphs_{result['backend']}", payload)


if __name__ == "__main__":
    main()
