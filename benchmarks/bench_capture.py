"""Capture time and graph memory of the decoder of ``bench_decoder_step.py``.

Captures one FULL CUDA graph per size of ``npu_graphs.plan_capture(max_size=256)``
(vLLM's default sizes up to 256 tokens: 1, 2, 4, 8, ..., 248, 256), largest first
into one shared pool, each a decode batch of that many requests with ~1024 tokens
of context, through ``npu_graphs.capture_all``. Kernels are compiled by eager warm-up
steps before the timed pass (compilation is a one-time cost per kernel variant, also
reported). Memory is the device memory in use after the pass minus before it.
Then a few captured sizes are replayed on a fresh step and compared with eager.

    python benchmarks/bench_capture.py
"""

from __future__ import annotations

import time

import _timing  # first: puts the packages' src on sys.path
import torch
from _decoder_model import DecoderConfig, LlamaDecoder
from bench_decoder_step import CONTEXT, DecodeSteps, capture, compare_graph_with_eager

from npu_graphs import (
    GraphWrapper,
    RuntimeMode,
    TaskRegistry,
    capture_all,
    plan_capture,
)

MAX_SIZE = 256


def main() -> None:
    device = _timing.require_cuda()
    config = DecoderConfig()
    capture_plan = plan_capture(max_size=MAX_SIZE)
    sizes = capture_plan.capture_order()
    num_blocks = DecodeSteps.num_blocks(MAX_SIZE, CONTEXT, config.block_size)
    model = LlamaDecoder(config, num_blocks, device)
    steps = DecodeSteps(model, MAX_SIZE, CONTEXT)
    registry = TaskRegistry("attention", expected_tasks=config.num_layers)
    wrapper = GraphWrapper(model, backend="cuda", mode=RuntimeMode.FULL, tasks=registry)

    start = time.perf_counter()
    for batch in (MAX_SIZE, 1):  # compiles the split and unsplit decode kernels
        model(*steps.inputs(batch), steps.make_step(batch, 0))
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start

    per_size: dict[int, float] = {}

    def capture_one(size: int) -> None:
        begin = time.perf_counter()
        capture(wrapper, steps, size, steps.make_step(size, 0))
        per_size[size] = time.perf_counter() - begin

    report = capture_all(sizes, capture_one, backend=wrapper.backend, progress=False)
    checks = {
        size: compare_graph_with_eager(wrapper, registry, steps, size) for size in (1, 8, 256)
    }
    rows = [
        {
            "graphs": len(report.keys),
            "sizes": f"{min(sizes)}..{max(sizes)}",
            "capture_s": report.seconds,
            "per_graph_ms": report.seconds / len(report.keys) * 1e3,
            "slowest_ms": max(per_size.values()) * 1e3,
            "memory_MiB": report.memory_bytes / 2**20,
            "warmup_compile_s": warmup_s,
        }
    ]
    _timing.print_table(list(rows[0]), rows)
    print("graph vs eager:", checks)
    _timing.write_json(
        "capture",
        {
            "environment": _timing.environment(device),
            "sizes": sizes,
            "capture_seconds": report.seconds,
            "memory_bytes": report.memory_bytes,
            "per_size_seconds": per_size,
            "warmup_compile_seconds": warmup_s,
            "graph_vs_eager": checks,
        },
    )


if __name__ == "__main__":
    main()
