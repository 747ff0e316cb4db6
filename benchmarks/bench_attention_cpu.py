"""CPU cost of ``npu_attention.plan`` and of ``run`` with the reference provider.

``plan``: microseconds per call for decode batches of 1, 64 and 512 requests
and a mixed batch of 512: without any provider's ``prepare`` (plan's own host
work), with the reference provider's ``prepare`` (its own time in the prepare
column), and with fixed buffers.

``run``: one layer (KV write + attention) of decode and prefill batches, small
and large, beside a baseline measured in the same process: the straightforward
per-request loop (read each request's lengths with ``.item()``, write its new
K/V, gather its pages, ``scaled_dot_product_attention`` in float32, copy the
rows out). Both compute in float32 from bf16 inputs; their outputs are checked
to agree before timing. Figures are wall-clock medians on this machine's CPU;
compare the ratio column across machines, not the microseconds.

    python benchmarks/bench_attention_cpu.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import _timing  # first: puts the packages' src on sys.path
import numpy as np
import torch
import torch.nn.functional as F

from npu_attention import AttentionSpec, PlanBuffers, plan, register_provider, run
from npu_attention.providers.reference import ReferenceProvider

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, DTYPE = 32, 8, 128, 128, torch.bfloat16
SPEC = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype=DTYPE)


class Batch:
    """Random batch: paged caches (permuted pages, block 0 reserved) and the step's tensors."""

    def __init__(self, query_lens: list[int], context_lens: list[int], num_decodes: int) -> None:
        rng = np.random.default_rng(0)
        self.query_lens, self.context_lens, self.num_decodes = query_lens, context_lens, num_decodes
        self.seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        self.cu_seqlens_q = [0, *np.cumsum(query_lens).tolist()]
        blocks = [-(-s // BLOCK_SIZE) for s in self.seq_lens]
        width = max(blocks)
        pages = 1 + rng.permutation(sum(blocks))
        self.block_tables = torch.zeros(len(blocks), width, dtype=torch.int32)
        starts = np.cumsum([0, *blocks])
        for i, n in enumerate(blocks):
            self.block_tables[i, :n] = torch.from_numpy(pages[starts[i] : starts[i] + n])
        positions = [np.arange(c, s) for c, s in zip(context_lens, self.seq_lens)]
        self.slot_mapping = torch.from_numpy(
            np.concatenate(
                [
                    self.block_tables[i, p // BLOCK_SIZE].numpy() * BLOCK_SIZE + p % BLOCK_SIZE
                    for i, p in enumerate(positions)
                ]
            ).astype(np.int64)
        )
        tokens, num_blocks = self.cu_seqlens_q[-1], 1 + sum(blocks)
        self.query = torch.randn(tokens, HEADS, HEAD_SIZE).to(DTYPE)
        self.key = torch.randn(tokens, KV_HEADS, HEAD_SIZE).to(DTYPE)
        self.value = torch.randn(tokens, KV_HEADS, HEAD_SIZE).to(DTYPE)
        cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
        self.key_cache = torch.randn(cache_shape).to(DTYPE)
        self.value_cache = torch.randn(cache_shape).to(DTYPE)

    def plan(self, buffers: PlanBuffers | None = None, provider: str | None = None):
        return plan(
            self.cu_seqlens_q,
            self.seq_lens,
            self.block_tables,
            self.slot_mapping,
            self.num_decodes,
            SPEC,
            buffers=buffers,
            provider=provider,
        )


def loop_baseline(
    query, key, value, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, slots, out
) -> torch.Tensor:
    """Per request: lengths via ``.item()``, K/V write, page gather, SDPA (float32)."""
    group = HEADS // KV_HEADS
    for i in range(seq_lens.shape[0]):
        start, end = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
        seq_len, q_len = seq_lens[i].item(), end - start
        req_slots = slots[start:end]
        key_cache[req_slots // BLOCK_SIZE, req_slots % BLOCK_SIZE] = key[start:end]
        value_cache[req_slots // BLOCK_SIZE, req_slots % BLOCK_SIZE] = value[start:end]
        pages = block_tables[i, : -(-seq_len // BLOCK_SIZE)].long()
        k = key_cache[pages].flatten(0, 1)[:seq_len].float().transpose(0, 1)
        v = value_cache[pages].flatten(0, 1)[:seq_len].float().transpose(0, 1)
        q = query[start:end].float().transpose(0, 1)
        context = seq_len - q_len
        mask = torch.arange(seq_len)[None, :] <= context + torch.arange(q_len)[:, None]
        o = F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), attn_mask=mask
        )
        out[start:end] = o.transpose(0, 1).to(out.dtype)
    return out


def median_us(fn: Callable[[], Any], min_seconds: float, max_reps: int = 2000) -> float:
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + min_seconds
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def decode_batch(num_reqs: int, context: int) -> Batch:
    rng = np.random.default_rng(num_reqs)
    contexts = rng.integers(context // 2, context + 1, num_reqs).tolist()
    return Batch([1] * num_reqs, contexts, num_reqs)


def mixed_batch(num_reqs: int) -> Batch:
    rng = np.random.default_rng(1)
    num_prefills = max(1, num_reqs // 16)
    queries = [1] * (num_reqs - num_prefills) + rng.integers(16, 256, num_prefills).tolist()
    contexts = rng.integers(0, 2048, num_reqs).tolist()
    return Batch(queries, contexts, num_reqs - num_prefills)


def prefill_batch(num_reqs: int, length: int, context: int) -> Batch:
    return Batch([length] * num_reqs, [context] * num_reqs, 0)


class PlanOnlyProvider(ReferenceProvider):
    """The reference provider without ``prepare``: times ``plan``'s own work."""

    name = "plan_only"

    def prepare(self, plan):
        return None


register_provider(PlanOnlyProvider.name, f"{__name__}:PlanOnlyProvider")


def plan_rows(min_seconds: float) -> list[dict[str, Any]]:
    rows = []
    for name, batch in [
        ("decode x1", decode_batch(1, 1024)),
        ("decode x64", decode_batch(64, 1024)),
        ("decode x512", decode_batch(512, 1024)),
        ("mixed x512", mixed_batch(512)),
    ]:
        rows.append(
            {
                "case": f"plan {name} (no provider prepare)",
                "ours_us": median_us(
                    lambda b=batch: b.plan(provider=PlanOnlyProvider.name), min_seconds
                ),
            }
        )
        step = batch.plan()
        rows.append(
            {
                "case": f"plan {name}",
                "ours_us": median_us(batch.plan, min_seconds),
                "prepare_us": median_us(lambda s=step: s.provider.prepare(s), min_seconds),
            }
        )
        buffers = PlanBuffers.allocate(512, 8192, batch.block_tables.shape[1])
        rows.append(
            {
                "case": f"plan {name} (buffers)",
                "ours_us": median_us(lambda b=batch, buf=buffers: b.plan(buf), min_seconds),
            }
        )
    return rows


def run_rows(min_seconds: float, quick: bool) -> list[dict[str, Any]]:
    cases = [
        ("decode 8 x ctx 512", decode_batch(8, 512)),
        ("decode 64 x ctx 1024", decode_batch(64, 1024)),
        ("prefill 2 x 128", prefill_batch(2, 128, 0)),
        ("mixed 64 (4 prefills)", mixed_batch(64)),
    ]
    if not quick:
        cases += [
            ("decode 256 x ctx 2048", decode_batch(256, 2048)),
            ("prefill 8 x 512 + ctx 512", prefill_batch(8, 512, 512)),
        ]
    return [_time_run(name, batch, min_seconds) for name, batch in cases]


def _time_run(name: str, batch: Batch, min_seconds: float) -> dict[str, Any]:
    step = batch.plan()
    out = torch.empty_like(batch.query)
    meta = (
        torch.tensor(batch.cu_seqlens_q, dtype=torch.int32),
        torch.tensor(batch.seq_lens, dtype=torch.int32),
        batch.block_tables,
        batch.slot_mapping,
    )
    tensors = (batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache)
    ours = run(*tensors, step, torch.empty_like(batch.query)).float()
    base = loop_baseline(*tensors, *meta, out).float()
    torch.testing.assert_close(ours, base, atol=2e-2, rtol=2e-2)
    ours_us = median_us(lambda: run(*tensors, step, out), min_seconds)
    base_us = median_us(lambda: loop_baseline(*tensors, *meta, out), min_seconds)
    return {
        "case": f"run {name}",
        "ours_us": ours_us,
        "loop_baseline_us": base_us,
        "speedup": base_us / ours_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small cases only, short timing")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: steady on shared CPUs)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    min_seconds = 0.2 if args.quick else 1.0
    rows = plan_rows(min_seconds) + run_rows(min_seconds, args.quick)
    _timing.print_table(["case", "ours_us", "prepare_us", "loop_baseline_us", "speedup"], rows)
    _timing.write_json(
        "bench_attention_cpu",
        {
            "environment": {
                "cpu": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "problem": {
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "head_size": HEAD_SIZE,
                "block_size": BLOCK_SIZE,
                "dtype": str(DTYPE),
            },
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
