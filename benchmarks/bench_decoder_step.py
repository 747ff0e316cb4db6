"""Decode step of a Llama-shaped decoder: eager vs a FULL CUDA graph with per-step task update.

Model (``_decoder_model.py``): 16 layers, hidden 2048, 16 query / 4 KV heads (head
size 128), MLP 8192, bf16, paged KV cache of block size 128; attention through
``npu_attention`` (triton provider) as ``npu_graphs`` updatable tasks. Each request
has about 1024 tokens of context (993 to 1025, changing every step).

Per step, both modes build the step's plan (``npu_attention.plan``); eager mode then
runs the model, graph mode calls ``TaskRegistry.update`` (copies the plan's device
tensors into the graph's fixed buffers) and replays. Reported per batch size:
- step time: wall time per step over a run of steps (host and device together);
- replay time: device time of one graph replay (CUDA events);
- host time per step of the benchmark's own inputs (``inputs_us``: the lengths uploaded
  in one pinned copy, as a model runner does, then positions and slots from them in
  small kernels), of ``plan`` alone and of ``update`` (``plan_us`` inside the step
  loop, where waiting for the device shows up too; ``idle_plan_us`` with the device
  idle; ``plan`` takes the uploaded lengths as ``device_lengths``, and
  ``idle_plan_upload_us`` is the same call uploading the host lengths itself);
- the memory-bound floor: bytes of weights and K/V read per step / copy bandwidth
  measured in the same run;
- ``proj_only_ms``: device time of a graph of the step's weight projections alone
  (``F.linear``, i.e. cuBLAS), the share of the replay no attention work can remove;
- graph vs eager outputs on a step other than the captured one: max abs difference
  (both bf16; they may differ by rounding only where the two plans chose a different
  number of KV splits); the check requires relative L2 error <= 1e-2.

    python benchmarks/bench_decoder_step.py [--steps N]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _timing  # first: puts the packages' src on sys.path
import numpy as np
import torch
import torch.nn.functional as F
from _decoder_model import DecoderConfig, LlamaDecoder

from npu_attention import AttentionPlan, plan
from npu_graphs import GraphWrapper, RuntimeMode, TaskRegistry, graph_dispatch

BATCHES = (1, 8, 32, 128)
PLAN_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXT = 1024
# plan uploading the host lengths itself, the same into fixed buffers, and with the
# lengths already on the device (as a model runner keeps them)
PLAN_LABELS = ("plan_us", "plan_buffers_us", "plan_device_lens_us")


class DecodeSteps:
    """Static input buffers and per-step plans for decode batches of up to ``max_batch``."""

    def __init__(self, model: LlamaDecoder, max_batch: int, context: int) -> None:
        c, device = model.config, model.device
        self.model, self.context = model, context
        self.width = -(-(context + 1) // c.block_size)
        order = torch.randperm(max_batch * self.width, generator=torch.Generator().manual_seed(0))
        self.block_tables = (order + 1).view(max_batch, self.width).to(torch.int32).to(device)
        self.hidden = torch.randn(max_batch, c.hidden_size, dtype=c.dtype, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        # The lengths on the device, as a model runner keeps them: cu_seqlens_q | seq_lens,
        # each at a fixed address whatever the batch (plan takes views of them).
        self.lengths = torch.zeros(2 * max_batch + 1, dtype=torch.int32, device=device)

    @staticmethod
    def num_blocks(max_batch: int, context: int, block_size: int) -> int:
        return 1 + max_batch * -(-(context + 1) // block_size)

    def seq_lens(self, batch: int, step_index: int) -> np.ndarray:
        return self.context - 31 + (np.arange(batch) + step_index) % 33

    def make_step(self, batch: int, step_index: int) -> AttentionPlan:
        """Fill the position buffer and plan one decode step of ``batch`` requests."""
        return self.plan_step(self.step_inputs(batch, step_index))

    def step_inputs(self, batch: int, step_index: int) -> tuple[Any, ...]:
        """Upload the step's lengths (one pinned copy), fill the position buffer from
        them; return ``plan``'s inputs (what a model runner has ready before it plans:
        host lengths, device block tables and slots, device lengths)."""
        seq_lens, cu_seqlens_q = self.seq_lens(batch, step_index), np.arange(batch + 1)
        cu_dev, seq_dev = self.upload_lengths(cu_seqlens_q, seq_lens)
        torch.sub(seq_dev, 1, out=self.positions[:batch])
        pos, tables = self.positions[:batch], self.block_tables[:batch]
        bs = self.model.config.block_size
        slots = tables.gather(1, (pos // bs)[:, None]).squeeze(1).long() * bs + pos % bs
        return cu_seqlens_q, seq_lens, tables, slots, batch, (cu_dev, seq_dev)

    def upload_lengths(
        self, cu_seqlens_q: np.ndarray, seq_lens: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the lengths into ``self.lengths`` (past the batch: the last offset
        repeated, length 0); return the views ``(cu_seqlens_q, seq_lens)``."""
        batch, cap = len(seq_lens), self.block_tables.shape[0]
        staged = torch.empty(2 * cap + 1, dtype=torch.int32, pin_memory=True)
        packed = staged.numpy()
        packed[: batch + 1], packed[batch + 1 : cap + 1] = cu_seqlens_q, cu_seqlens_q[-1]
        packed[cap + 1 : cap + 1 + batch], packed[cap + 1 + batch :] = seq_lens, 0
        self.lengths.copy_(staged, non_blocking=True)
        return self.lengths[: batch + 1], self.lengths[cap + 1 : cap + 1 + batch]

    def plan_step(self, inputs: tuple[Any, ...], lengths_on_device: bool = True) -> AttentionPlan:
        """``plan`` of one step: with the device lengths, or uploading the host lengths
        itself."""
        *args, device_lengths = inputs
        return plan(*args, self.model.spec, device=self.model.device, provider="triton",
                    device_lengths=device_lengths if lengths_on_device else None)  # fmt: skip

    def inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hidden[:batch], self.positions[:batch]


def eager_step_ms(steps: DecodeSteps, batch: int, num_steps: int) -> float:
    for i in range(3):
        steps.model(*steps.inputs(batch), steps.make_step(batch, i))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(num_steps):
        steps.model(*steps.inputs(batch), steps.make_step(batch, i))
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / num_steps


def capture(wrapper: GraphWrapper, steps: DecodeSteps, batch: int, step: AttentionPlan) -> None:
    """First call for a key: the wrapper captures the graph."""
    with graph_dispatch(RuntimeMode.FULL, key=batch):
        wrapper(*steps.inputs(batch), step)


def graph_step(
    wrapper: GraphWrapper,
    registry: TaskRegistry,
    steps: DecodeSteps,
    batch: int,
    step: AttentionPlan,
) -> torch.Tensor:
    registry.update(batch, step)
    with graph_dispatch(RuntimeMode.FULL, key=batch):
        return wrapper(*steps.inputs(batch), step)


def measure_graph(
    wrapper: GraphWrapper, registry: TaskRegistry, steps: DecodeSteps, batch: int, num_steps: int
) -> dict[str, float]:
    for i in range(3):
        graph_step(wrapper, registry, steps, batch, steps.make_step(batch, i))
    torch.cuda.synchronize()
    inputs_s = plan_s = update_s = 0.0
    start = time.perf_counter()
    for i in range(num_steps):
        t0 = time.perf_counter()
        inputs = steps.step_inputs(batch, i)
        t1 = time.perf_counter()
        step = steps.plan_step(inputs)
        t2 = time.perf_counter()
        registry.update(batch, step)
        t3 = time.perf_counter()
        with graph_dispatch(RuntimeMode.FULL, key=batch):
            wrapper(*steps.inputs(batch), step)
        inputs_s, plan_s, update_s = inputs_s + t1 - t0, plan_s + t2 - t1, update_s + t3 - t2
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) * 1e3 / num_steps
    replays = []
    for _ in range(20):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        wrapper.replay(batch)
        end.record()
        end.synchronize()
        replays.append(begin.elapsed_time(end))
    idle_plan_s = {True: 0.0, False: 0.0}  # plan alone, nothing queued on the device
    for i in range(num_steps):
        for on_device in idle_plan_s:
            inputs = steps.step_inputs(batch, i)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps.plan_step(inputs, lengths_on_device=on_device)
            idle_plan_s[on_device] += time.perf_counter() - t0
    return {
        "graph_step_ms": step_ms,
        "idle_plan_host_us": idle_plan_s[True] * 1e6 / num_steps,
        "idle_plan_upload_host_us": idle_plan_s[False] * 1e6 / num_steps,
        "replay_ms": float(np.median(replays)),
        "inputs_host_us": inputs_s * 1e6 / num_steps,
        "plan_host_us": plan_s * 1e6 / num_steps,
        "update_host_us": update_s * 1e6 / num_steps,
    }


def projections_only_ms(model: LlamaDecoder, batch: int) -> float:
    """Device time of a graph of the step's weight projections alone (the cuBLAS share)."""
    c = model.config
    x = torch.randn(batch, c.hidden_size, dtype=c.dtype, device=model.device)
    h = torch.randn(batch, c.intermediate_size, dtype=c.dtype, device=model.device)

    def projections() -> None:
        for layer in model.layers:
            F.linear(x, layer["qkv"])
            F.linear(x, layer["o"])
            F.linear(x, layer["gate_up"])
            F.linear(h, layer["down"])

    projections()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        projections()
    times = []
    for _ in range(20):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return float(np.median(times))


def compare_graph_with_eager(
    wrapper: GraphWrapper, registry: TaskRegistry, steps: DecodeSteps, batch: int
) -> dict[str, float]:
    step = steps.make_step(batch, 17)  # not the captured step
    eager = steps.model(*steps.inputs(batch), step).float()
    graph = graph_step(wrapper, registry, steps, batch, step).float()
    difference = (graph - eager).abs().max().item()
    relative = ((graph - eager).norm() / eager.norm()).item()
    if not relative <= 1e-2:
        raise SystemExit(f"batch {batch}: graph output differs from eager (relative {relative})")
    return {"max_abs_diff": difference, "rel_l2_diff": relative, "bitwise_equal": difference == 0}


def plan_host_sweep(
    model: LlamaDecoder, steps: DecodeSteps, repeats: int = 200, rounds: int = 3
) -> list[dict]:
    """Median host time of ``plan`` alone, the device idle, for decode batches of 1..256
    requests (inputs prepared beforehand: host lengths, device tables and slots), without
    and with fixed buffers, and with the lengths given on the device. The sizes are
    measured in ``rounds`` rounds, in alternating order (ascending, descending, ...),
    each a median of ``repeats`` calls after a warm-up:
    ``plan_us`` is the median of the rounds' medians and ``plan_us_worst`` the slowest
    round's (a round disturbed by something else on the host shows there)."""
    from npu_attention import PlanBuffers

    spec, device = model.spec, model.device
    max_batch = steps.block_tables.shape[0]
    buffers = PlanBuffers.allocate(max_batch, max_batch, steps.width, device=device)
    sizes = [batch for batch in PLAN_BATCHES if batch <= max_batch]
    samples: dict[tuple[int, str], list[float]] = {}
    for round_index in range(rounds):
        for batch in sizes if round_index % 2 == 0 else sizes[::-1]:
            seq_lens = steps.seq_lens(batch, 0)
            cu_seqlens_q = np.arange(batch + 1)
            tables = steps.block_tables[:batch]
            slots = torch.arange(batch, dtype=torch.int64, device=device)
            lengths = steps.upload_lengths(cu_seqlens_q, seq_lens)
            for label, fixed, device_lengths in (
                ("plan_us", None, None),
                ("plan_buffers_us", buffers, None),
                ("plan_device_lens_us", None, lengths),
            ):
                times = []
                for _ in range(repeats + 20):  # the first 20: warm-up
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    plan(cu_seqlens_q, seq_lens, tables, slots, batch, spec,
                         device=device, provider="triton", buffers=fixed,
                         device_lengths=device_lengths)  # fmt: skip
                    times.append(time.perf_counter() - t0)
                samples.setdefault((batch, label), []).append(float(np.median(times[20:])) * 1e6)
    rows = []
    for batch in sizes:
        row: dict[str, Any] = {"batch": batch}
        for label in PLAN_LABELS:
            medians = samples[(batch, label)]
            row[label] = float(np.median(medians))
            row[f"{label}_worst"] = max(medians)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps per batch size")
    parser.add_argument(
        "--plan-only", action="store_true", help="only the host time of plan, 1..256 requests"
    )
    args = parser.parse_args()
    device = _timing.require_cuda()
    copy_bw = _timing.copy_bandwidth(device)
    config = DecoderConfig()
    max_batch = max(*BATCHES, *PLAN_BATCHES)
    num_blocks = DecodeSteps.num_blocks(max_batch, CONTEXT, config.block_size)
    model = LlamaDecoder(config, num_blocks, device)
    steps = DecodeSteps(model, max_batch, CONTEXT)
    plan_rows = plan_host_sweep(model, steps)
    print("host time of plan (median, device idle), decode batches:")
    _timing.print_table(list(plan_rows[0]), plan_rows)
    if args.plan_only:
        _timing.write_json("plan_host", {"environment": _timing.environment(device),
                                         "rows": plan_rows})  # fmt: skip
        return
    registry = TaskRegistry("attention", expected_tasks=config.num_layers)
    wrapper = GraphWrapper(model, backend="cuda", mode=RuntimeMode.FULL, tasks=registry)
    rows: list[dict[str, Any]] = []
    for batch in BATCHES:
        eager_ms = eager_step_ms(steps, batch, args.steps)
        capture(wrapper, steps, batch, steps.make_step(batch, 0))
        check = compare_graph_with_eager(wrapper, registry, steps, batch)
        graph = measure_graph(wrapper, registry, steps, batch, args.steps)
        seq_lens = [int(s) for s in steps.seq_lens(batch, 0)]
        floor_ms = (model.weight_bytes() + model.kv_bytes_read(seq_lens)) / copy_bw * 1e3
        projections_ms = projections_only_ms(model, batch)
        rows.append({
            "batch": batch,
            "eager_step_ms": eager_ms,
            "graph_step_ms": graph["graph_step_ms"],
            "replay_ms": graph["replay_ms"],
            "floor_ms": floor_ms,
            "replay/floor": graph["replay_ms"] / floor_ms,
            "proj_only_ms": projections_ms,
            "step/floor": graph["graph_step_ms"] / floor_ms,
            "inputs_us": graph["inputs_host_us"],
            "plan_us": graph["plan_host_us"],
            "idle_plan_us": graph["idle_plan_host_us"],
            "idle_plan_upload_us": graph["idle_plan_upload_host_us"],
            "update_us": graph["update_host_us"],
            "update/step": graph["update_host_us"] * 1e-3 / graph["graph_step_ms"],
            "speedup": eager_ms / graph["graph_step_ms"],
            "max_abs_diff": check["max_abs_diff"],
            "rel_l2_diff": check["rel_l2_diff"],
        })  # fmt: skip
        print(rows[-1])
    print(
        f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s; weights {model.weight_bytes() / 1e9:.2f} GB"
    )
    _timing.print_table(list(rows[0]), rows)
    print("host time of plan (median, device idle) beside the step it feeds:")
    _timing.print_table(list(plan_rows[0]), plan_rows)
    _timing.write_json(
        "decoder_step",
        {
            "environment": _timing.environment(device),
            "copy_bandwidth_GBps": copy_bw / 1e9,
            "config": {k: str(v) for k, v in vars(config).items()},
            "context": CONTEXT,
            "weight_bytes": model.weight_bytes(),
            "rows": rows,
            "plan_host_rows": plan_rows,
        },
    )


if __name__ == "__main__":
    main()
