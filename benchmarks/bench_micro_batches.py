"""Host overhead of the bridge's micro-batch wrapper (DBO) per step, on the CPU.

What the wrapper adds to a step vLLM splits into two micro-batches, beside the model's
own work: a thread per micro-batch (started and joined every split forward), a
forward context per micro-batch, and a hand-over between the threads at each MoE
dispatch and combine (two per MoE layer per micro-batch). The model here does almost
no work (a 16 x 64 add per layer, a no-op "collective"), so the figures are the
wrapper's and Python's own. For each number of MoE layers it measures, in one run:

* ``sequential``: both micro-batches run one after the other on the calling thread,
  each under its own forward context, no threads, no hand-over (the same model work);
* ``split``: the step through ``BridgeUBatchWrapper`` (threads, hand-overs);
* ``whole``: the step unsplit through the wrapper (what a step below vLLM's
  threshold costs).

``split - sequential`` is the wrapper's overhead per split step; its growth with the
layers, divided by the hand-overs, the cost of one hand-over. A FULL-graph replay of a
split step runs none of this (the graph holds the interleaving; the host then only
updates each micro-batch's attention tasks), so on an NPU these costs are paid by
split steps that run eagerly (prefills above the prefill threshold) and by captures.

CPU figures: each time is the median of ``--steps`` wall-clock steps, and of
``--rounds`` rounds over every layer count the smallest median is kept (the round
least disturbed by other work on the machine); a first round is thrown away (warm-up).
Host costs and ratios only.

    python benchmarks/bench_micro_batches.py [--layers 0 2 8 32 61] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import _timing  # first: puts the packages' src on sys.path
import torch

TOKENS, HIDDEN = 16, 64


def _setup() -> Any:
    from vllm.config import VllmConfig

    config = VllmConfig()
    config.parallel_config.enable_dbo = True  # as the worker restores it
    return config


class MoELayers(torch.nn.Module):
    """``layers`` x (add, dispatch collective, add, combine collective)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = layers
        self.bias = torch.zeros(HIDDEN)

    def forward(self, input_ids: Any, positions: Any, inputs_embeds: Any, **_: Any) -> Any:
        from npu_vllm_bridge.graphs.ubatch_wrapper import micro_batch_collective

        x = inputs_embeds
        for _ in range(self.layers):
            x = x + self.bias
            with micro_batch_collective():  # MoE dispatch
                pass
            x = x + self.bias
            with micro_batch_collective():  # MoE combine
                pass
        return x


def _median_us(fn: Any, steps: int) -> float:
    for _ in range(max(steps // 10, 3)):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(layers: int, steps: int) -> dict[str, Any]:
    from vllm.forward_context import (
        BatchDescriptor,
        create_forward_context,
        override_forward_context,
        set_forward_context,
    )
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    from npu_vllm_bridge.graphs.ubatch_wrapper import BridgeUBatchWrapper

    config = _setup()
    model = MoELayers(layers)
    wrapper = BridgeUBatchWrapper(model, config, full_graphs=False, graph_backend="host")
    half = TOKENS // 2
    slices = [
        UBatchSlice(slice(0, 4), slice(0, half)),
        UBatchSlice(slice(4, 8), slice(half, TOKENS)),
    ]
    inputs = {
        "input_ids": torch.zeros(TOKENS, dtype=torch.int64),
        "positions": torch.zeros(TOKENS, dtype=torch.int64),
        "inputs_embeds": torch.randn(TOKENS, HIDDEN),
    }
    key = BatchDescriptor(num_tokens=TOKENS)
    contexts = [create_forward_context({}, config, batch_descriptor=key) for _ in slices]

    def split() -> None:
        with set_forward_context([{}, {}], config, batch_descriptor=key, ubatch_slices=slices):
            wrapper(**inputs)

    def whole() -> None:
        with set_forward_context({}, config, batch_descriptor=key):
            wrapper(**inputs)

    def sequential() -> None:
        parts = [{k: v[s.token_slice] for k, v in inputs.items()} for s in slices]
        outputs = []
        for context, part in zip(contexts, parts, strict=True):
            with override_forward_context(context):
                outputs.append(model(**part))
        torch.cat(outputs)

    wrapper.counters.reset()
    with torch.inference_mode():
        row = {
            "moe_layers": layers,
            "hand_overs": 0,
            "sequential_us": _median_us(sequential, steps),
            "split_us": _median_us(split, steps),
            "whole_us": _median_us(whole, steps),
        }
    row["hand_overs"] = wrapper.counters.yields_per_split_forward
    row["overhead_us"] = row["split_us"] - row["sequential_us"]
    return row


TIMES = ("sequential_us", "split_us", "whole_us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 2, 8, 32, 61])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    measure(args.layers[0], args.steps)  # warm-up round, thrown away
    rounds = [[measure(layers, args.steps) for layers in args.layers] for _ in range(args.rounds)]
    rows = []
    for index in range(len(args.layers)):
        row = dict(rounds[0][index])
        for name in TIMES:
            row[name] = min(r[index][name] for r in rounds)
        row["overhead_us"] = row["split_us"] - row["sequential_us"]
        rows.append(row)
    base = rows[0] if rows[0]["hand_overs"] == 0 else None
    for row in rows:
        extra = row["overhead_us"] - (base["overhead_us"] if base else 0.0)
        row["us_per_hand_over"] = extra / row["hand_overs"] if row["hand_overs"] else None
    _timing.print_table(
        ["moe_layers", "hand_overs", "sequential_us", "split_us", "whole_us", "overhead_us",
         "us_per_hand_over"],
        rows,
    )  # fmt: skip
    _timing.write_json(
        "micro_batches",
        {"device": "cpu", "cpus": os.cpu_count(), "torch": torch.__version__,
         "python": platform.python_version(), "torch_threads": 1, "tokens": TOKENS,
         "steps": args.steps, "rounds": args.rounds, "rows": rows},
    )  # fmt: skip


if __name__ == "__main__":
    main()
