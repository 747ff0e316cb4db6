"""MLA decode (triton provider, absorbed) vs torch matmul-softmax-matmul, and vs copy bandwidth.

Problem: DeepSeek-V3 attention on one device of a tensor-parallel 8 deployment:
16 query heads, kv_lora_rank 512, rope 64 (a latent row of 576 bf16 values,
1152 bytes per token), one query token per request, context 4096, batch 1, 64 and
256; the paged latent cache has block size 64 over permuted pages. ``--heads 128``
runs the whole model's heads instead.

Bandwidth = latent-cache bytes read (batch x context x 1152) / time. Rows: the
provider's default (``triton``: the Gluon kernel on Hopper GPUs with Triton 3.6), the
portable Triton kernel (``portable``, the Gluon kernel switched off), and torch's
``bmm -> softmax -> bmm`` over the same latents gathered beforehand into a contiguous
``[batch, context, 576]`` tensor (the gather not timed); and a device-to-device copy
(bytes read + written). All timed in the same run as CUDA-graph replays, the L2
cache cleared before each replay; ``x portable`` and ``x bmm`` are the default's
speed-ups. ``--tune`` also times a grid of launches of the default kernel (tiles and
ring stages, split counts, heads a program) and prints them fastest first.

    python benchmarks/bench_mla_decode.py [--heads 16] [--tune] [--batches 1 64 256]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import _timing  # first: puts the packages' src on sys.path
import torch

from npu_attention import plan
from npu_attention.mla import MLASpec, allocate_latent_cache, mla_decode

LATENT, ROPE, CONTEXT, BLOCK_SIZE, DTYPE = 512, 64, 4096, 64, torch.bfloat16
BATCHES = (1, 64, 256)


class Problem:
    """Queries and a paged latent cache of one batch; the same latents contiguous."""

    def __init__(
        self, spec: MLASpec, batch: int, device: torch.device, context: int = CONTEXT
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(batch)
        self.context = context
        pages = -(-context // BLOCK_SIZE)
        order = torch.randperm(batch * pages, generator=gen, device=device) + 1
        self.block_tables = order.view(batch, pages).to(torch.int32)
        self.cache = allocate_latent_cache(1 + batch * pages, spec, device)
        for plane in self.cache:
            plane.normal_(generator=gen)
        self.q_latent = torch.randn(batch, spec.num_heads, LATENT, generator=gen, device=device)
        self.q_latent = self.q_latent.to(DTYPE)
        self.q_rope = torch.randn(batch, spec.num_heads, ROPE, generator=gen, device=device)
        self.q_rope = self.q_rope.to(DTYPE)
        self.out = torch.empty_like(self.q_latent)
        self.spec, self.batch = spec, batch
        self.step = plan(
            list(range(batch + 1)),
            [context] * batch,
            self.block_tables,
            torch.full((batch,), -1, dtype=torch.int64, device=device),
            batch,
            spec,
            provider="triton",
        )
        # the baseline's input: latents gathered into [batch, context, 576]
        rows = self.block_tables.long()
        self.latent = torch.cat([self.cache.kv_c[rows], self.cache.k_pe[rows]], dim=-1)
        self.latent = self.latent.view(batch, pages * BLOCK_SIZE, LATENT + ROPE)[:, :context]
        self.query = torch.cat([self.q_latent, self.q_rope], dim=-1)  # [batch, heads, 576]

    @property
    def latent_bytes(self) -> int:
        return self.batch * self.context * (LATENT + ROPE) * DTYPE.itemsize

    def triton(self) -> torch.Tensor:
        return mla_decode(self.q_latent, self.q_rope, self.cache, self.step, self.out)

    def torch_baseline(self) -> torch.Tensor:
        scores = torch.bmm(self.query, self.latent.transpose(1, 2)).float()
        probs = torch.softmax(scores * self.spec.softmax_scale, dim=-1).to(DTYPE)
        return torch.bmm(probs, self.latent[..., :LATENT])


def time_row(problem: Problem, name: str, fn, copy_bw: float, **extra: Any) -> dict[str, Any]:
    ms = _timing.graph_median_ms(fn)
    bandwidth = problem.latent_bytes / (ms * 1e-3)
    return {
        "batch": problem.batch,
        "kernel": name,
        "us": ms * 1e3,
        "GB/s": bandwidth / 1e9,
        "of_copy": bandwidth / copy_bw,
        **extra,
    }


@contextlib.contextmanager
def provider_settings(problem: Problem, **settings: Any) -> Iterator[None]:
    """The provider's attributes set to ``settings`` (the step re-planned) inside."""
    provider = problem.step.provider
    saved = {name: getattr(provider, name) for name in settings}
    vars(provider).update(settings)
    problem.step.provider_data = provider.prepare(problem.step)
    try:
        yield
    finally:
        vars(provider).update(saved)
        problem.step.provider_data = provider.prepare(problem.step)


def launch_grid(problem: Problem) -> list[dict[str, Any]]:
    """The launches ``--tune`` tries. Gluon kernel: its ring (keys a tile, stages) at
    the default split count, then other split counts; portable kernel: tile shapes,
    then split counts."""
    batch = problem.batch
    splits = (8, 16, 32, 64) if batch == 1 else (1, 2, 4)
    split_rows = [dict(fixed_kv_splits=n) for n in splits]
    if problem.step.provider_data.hopper is None:
        tiles = [
            dict(block_n=block_n, num_warps=warps, num_stages=stages)
            for block_n, warps, stages in itertools.product((32, 64), (4, 8), (2, 3))
        ]
        return tiles + split_rows
    wide = problem.spec.num_heads > 16
    rings = ((64, 1), (32, 3), (32, 2)) if wide else ((32, 3), (32, 5))
    tiles = [dict(hopper_launch={"block_n": n, "num_stages": stages}) for n, stages in rings]
    heads = [dict(hopper_min_programs=share) for share in (0, 1)] if wide else []
    return tiles + split_rows + heads


def describe(problem: Problem) -> str:
    data = problem.step.provider_data
    if data.hopper is not None:
        launch = data.hopper
        return (
            f"gluon h{launch.heads} n{launch.block_n} s{launch.stages} splits={data.num_kv_splits}"
        )
    config = data.decode
    return (
        f"portable n{config.block_n} w{config.num_warps} s{config.num_stages} "
        f"splits={data.num_kv_splits}"
    )


def max_error(problem: Problem) -> float:
    return (problem.triton().float() - problem.torch_baseline().float()).abs().max().item()


def tuned_rows(problem: Problem, copy_bw: float) -> list[dict[str, Any]]:
    rows = []
    for launch in launch_grid(problem):
        with provider_settings(problem, **launch):
            config = describe(problem)
            try:
                error = max_error(problem)
                rows.append(
                    time_row(
                        problem, "triton", problem.triton, copy_bw, config=config, max_err=error
                    )
                )
            except Exception as failure:  # a launch the compiler or the GPU refuses
                print(f"skipped {config}: {type(failure).__name__}: {str(failure)[:80]}")
    return sorted(rows, key=lambda row: row["us"])


def default_rows(problem: Problem, copy_bw: float) -> list[dict[str, Any]]:
    """The default kernel, the portable one (where the default is another), torch bmm."""
    ours = time_row(
        problem,
        "triton",
        problem.triton,
        copy_bw,
        config=describe(problem),
        max_err=max_error(problem),
    )
    rows = [ours]
    if problem.step.provider_data.hopper is not None:
        with provider_settings(problem, hopper_decode=False):
            rows.append(
                time_row(
                    problem,
                    "portable",
                    problem.triton,
                    copy_bw,
                    config=describe(problem),
                    max_err=max_error(problem),
                )
            )
    rows.append(time_row(problem, "torch bmm", problem.torch_baseline, copy_bw))
    for row in rows[1:]:
        ours["x " + row["kernel"].split()[-1]] = row["us"] / ours["us"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument(
        "--context", type=int, default=CONTEXT, help="keys a request (64: one tile, the floor)"
    )
    args = parser.parse_args()
    device = _timing.require_cuda()
    spec = MLASpec(
        num_heads=args.heads,
        kv_lora_rank=LATENT,
        qk_nope_head_dim=128,
        qk_rope_head_dim=ROPE,
        v_head_dim=128,
        block_size=BLOCK_SIZE,
        dtype=DTYPE,
    )
    copy_bw = _timing.copy_bandwidth(device)
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows, best = [], []
    for batch in args.batches:
        problem = Problem(spec, batch, device, args.context)
        rows.extend(default_rows(problem, copy_bw))
        if args.tune:
            best.extend(tuned_rows(problem, copy_bw))
        del problem
        torch.cuda.empty_cache()
    columns = ["batch", "kernel", "us", "GB/s", "of_copy", "x portable", "x bmm", "config"]
    _timing.print_table([*columns, "max_err"], rows)
    if best:
        print("\nbest launches (--tune):")
        _timing.print_table(["batch", "config", "us", "GB/s", "of_copy", "max_err"], best)
    _timing.write_json(
        f"mla_decode_h{args.heads}" + ("" if args.context == CONTEXT else f"_c{args.context}"),
        {
            "problem": {
                "heads": args.heads,
                "kv_lora_rank": LATENT,
                "rope": ROPE,
                "context": args.context,
                "block_size": BLOCK_SIZE,
                "dtype": str(DTYPE),
            },
            "environment": _timing.environment(device),
            "copy_bandwidth_bytes_per_s": copy_bw,
            "rows": rows,
            "tuned": best,
        },
    )


if __name__ == "__main__":
    main()
