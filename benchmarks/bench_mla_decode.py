"""MLA decode (triton provider, absorbed) vs torch matmul-softmax-matmul, and vs copy bandwidth.

Problem: DeepSeek-V3 attention on one device of a tensor-parallel 8 deployment:
16 query heads, kv_lora_rank 512, rope 64 (a latent row of 576 bf16 values,
1152 bytes per token), one query token per request, context 4096, batch 1, 64 and
256; the paged latent cache (token-interleaved, vLLM's and FlashMLA's layout) has
block size 64 over permuted pages. ``--heads 128`` runs the whole model's heads
instead (data-parallel attention); ``--tokens 1 2 3 4`` query tokens a request
(speculative decoding, causal among themselves; each set of rows its own table).

Bandwidth = latent-cache bytes read (batch x context x 1152) / time. Rows: the
provider's default (``triton``: the Gluon kernel on Hopper GPUs with Triton 3.6), the
portable Triton kernel (``portable``, the Gluon kernels switched off; one-token rows
only), the ``mma.sync`` Gluon kernel where the default is the warpgroup-MMA one
(``mma.sync``), FlashMLA's sm90 dense decode (``flashmla``, where the ``flash_mla``
module imports: the same queries and cache in the same process; otherwise the run
says it was not found), and torch's
``bmm -> softmax -> bmm`` over the same latents gathered beforehand into a contiguous
``[batch, context, 576]`` tensor (the gather not timed); and a device-to-device copy
(bytes read + written). All timed in the same run as CUDA-graph replays, the L2
cache cleared before each replay, in 3 interleaved rounds (median; ``spread_%``:
max - min of the rounds); ``x <peer>`` is the peer's time over the default's (above 1:
the default is faster); TFLOP/s counts ``2 x rows x keys x (576 + 512)``. ``--tune`` also times a grid of launches of the default kernel (tiles and
ring stages, split counts, heads a program) and prints them fastest first.

    python benchmarks/bench_mla_decode.py [--heads 16] [--tokens 1] [--tune]
        [--batches 1 64 256]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import _timing  # first: puts the packages' src on sys.path
import torch

from npu_attention import plan
from npu_attention.mla import MLASpec, mla_decode, split_latent_cache

LATENT, ROPE, CONTEXT, BLOCK_SIZE, DTYPE = 512, 64, 4096, 64, torch.bfloat16
BATCHES = (1, 64, 256)


class Problem:
    """Queries and a paged, token-interleaved latent cache of one batch (``tokens``
    query tokens a request, the last ``tokens`` of its ``context`` keys); the same
    latents contiguous for the torch baseline."""

    def __init__(
        self, spec: MLASpec, batch: int, device: torch.device, context: int = CONTEXT
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(batch)
        self.context, self.tokens = context, 1 + spec.num_speculative_tokens
        pages = -(-context // BLOCK_SIZE)
        order = torch.randperm(batch * pages, generator=gen, device=device) + 1
        self.block_tables = order.view(batch, pages).to(torch.int32)
        self.storage = torch.randn(
            1 + batch * pages, BLOCK_SIZE, LATENT + ROPE, generator=gen, device=device
        ).to(DTYPE)
        self.cache = split_latent_cache(self.storage, spec)
        rows = batch * self.tokens
        self.q_latent = torch.randn(rows, spec.num_heads, LATENT, generator=gen, device=device)
        self.q_latent = self.q_latent.to(DTYPE)
        self.q_rope = torch.randn(rows, spec.num_heads, ROPE, generator=gen, device=device)
        self.q_rope = self.q_rope.to(DTYPE)
        self.out = torch.empty_like(self.q_latent)
        self.spec, self.batch = spec, batch
        self.step = plan(
            [i * self.tokens for i in range(batch + 1)],
            [context] * batch,
            self.block_tables,
            torch.full((rows,), -1, dtype=torch.int64, device=device),
            batch,
            spec,
            provider="triton",
        )
        self.query = torch.cat([self.q_latent, self.q_rope], dim=-1)  # [rows, heads, 576]
        self.latent = None  # the baseline's input, gathered on first use
        self.flash_meta = None

    @property
    def latent_bytes(self) -> int:
        return self.batch * self.context * (LATENT + ROPE) * DTYPE.itemsize

    @property
    def flops(self) -> float:
        rows = self.batch * self.tokens * self.spec.num_heads
        return 2.0 * rows * self.context * (LATENT + ROPE + LATENT)

    def triton(self) -> torch.Tensor:
        return mla_decode(self.q_latent, self.q_rope, self.cache, self.step, self.out)

    def torch_baseline(self) -> torch.Tensor:
        """Every query row against all of its request's keys (spec rows unmasked: a
        baseline of the bytes and flops, compared only at one token)."""
        if self.latent is None:  # latents gathered into [batch, context, 576]
            pages = self.block_tables.long()
            latent = self.storage[pages].view(self.batch, -1, LATENT + ROPE)
            self.latent = latent[:, : self.context].contiguous()
        query = self.query.view(self.batch, self.tokens * self.spec.num_heads, -1)
        scores = torch.bmm(query, self.latent.transpose(1, 2)).float()
        probs = torch.softmax(scores * self.spec.softmax_scale, dim=-1).to(DTYPE)
        return torch.bmm(probs, self.latent[..., :LATENT]).view_as(self.out)

    def flashmla(self) -> torch.Tensor:
        """FlashMLA's dense decode on the same queries and cache."""
        import flash_mla

        if self.flash_meta is None:
            self.flash_meta = flash_mla.get_mla_metadata()[0]
            self.flash_q = self.query.view(self.batch, self.tokens, self.spec.num_heads, -1)
            self.flash_cache = self.storage.view(-1, BLOCK_SIZE, 1, LATENT + ROPE)
            self.flash_lens = self.step.seq_lens[: self.batch]
        out, _ = flash_mla.flash_mla_with_kvcache(
            self.flash_q,
            self.flash_cache,
            self.block_tables,
            self.flash_lens,
            LATENT,
            self.flash_meta,
            softmax_scale=self.spec.softmax_scale,
            causal=self.tokens > 1,
        )
        return out.view_as(self.out)


def flashmla_available() -> bool:
    try:
        import flash_mla  # noqa: F401
    except ImportError as failure:
        print(f"flash_mla not found ({failure}): FlashMLA rows left out")
        return False
    return True


def graph_of(fn):
    """``fn`` captured as a CUDA graph (called once before, to compile and warm up)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def timed_rows(problem: Problem, fns: dict[str, Any], copy_bw: float) -> dict[str, dict]:
    """Each of ``fns`` as a graph replay, timed in 3 interleaved rounds."""
    graphs = {name: graph_of(fn) for name, fn in fns.items()}
    times = _timing.interleaved_median_ms({name: g.replay for name, g in graphs.items()})
    rows = {}
    for name, (ms, spread) in times.items():
        bandwidth = problem.latent_bytes / (ms * 1e-3)
        rows[name] = {
            "batch": problem.batch,
            "tokens": problem.tokens,
            "kernel": name,
            "us": ms * 1e3,
            "GB/s": bandwidth / 1e9,
            "of_copy": bandwidth / copy_bw,
            "TFLOP/s": problem.flops / (ms * 1e-3) / 1e12,
            "spread_%": spread,
        }
    return rows


def time_row(problem: Problem, name: str, fn, copy_bw: float, **extra: Any) -> dict[str, Any]:
    return {**timed_rows(problem, {name: fn}, copy_bw)[name], **extra}


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
    if problem.step.provider_data.hopper.wide:
        return split_rows
    wide = problem.spec.num_heads > 16
    rings = ((64, 1), (32, 3), (32, 2)) if wide else ((32, 3), (32, 5))
    tiles = [dict(hopper_launch={"block_n": n, "num_stages": stages}) for n, stages in rings]
    heads = [dict(hopper_min_programs=share) for share in (0, 1)] if wide else []
    return tiles + split_rows + heads


def describe(problem: Problem) -> str:
    data = problem.step.provider_data
    if data.hopper is not None:
        launch = data.hopper
        kind = "wgmma" if launch.wide else "gluon"
        return (
            f"{kind} h{launch.heads} n{launch.block_n} s{launch.stages} splits={data.num_kv_splits}"
        )
    config = data.decode
    return (
        f"portable n{config.block_n} w{config.num_warps} s{config.num_stages} "
        f"splits={data.num_kv_splits}"
    )


def max_error(problem: Problem, fn=None) -> float:
    """Largest difference of ``fn`` (the default kernel) from FlashMLA where it runs,
    else (one query token) from torch bmm; NaN without a reference."""
    fn = fn or problem.triton
    if problem.flash_meta is not None:
        reference = problem.flashmla()
    elif problem.tokens == 1:
        reference = problem.torch_baseline()
    else:
        return float("nan")
    return (fn().float() - reference.float()).abs().max().item()


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


def default_rows(problem: Problem, copy_bw: float, flash: bool) -> list[dict[str, Any]]:
    """The default kernel, FlashMLA, the ``mma.sync`` Gluon kernel (where the default
    is the warpgroup-MMA one), the portable one (one token), torch bmm (one token):
    graphs of each, timed in interleaved rounds. Each other kernel is captured with
    the provider's settings for it, so its graph replays that kernel."""
    fns = {"triton": problem.triton}
    configs = {"triton": describe(problem)}
    if flash:
        problem.flashmla()  # its schedule, made on the first call
        fns["flashmla"] = problem.flashmla
    errors = {"triton": max_error(problem)}
    others = []
    hopper = problem.step.provider_data.hopper
    if hopper is not None and hopper.wide:
        others.append(("mma.sync", dict(hopper_wide_decode=False)))
    if hopper is not None and problem.tokens == 1:
        others.append(("portable", dict(hopper_decode=False)))
    graphs = {}
    for name, settings in others:
        with provider_settings(problem, **settings):
            configs[name] = describe(problem)
            errors[name] = max_error(problem)
            graphs[name] = graph_of(problem.triton)
    if problem.tokens == 1:
        fns["torch bmm"] = problem.torch_baseline
    graphs.update({name: graph_of(fn) for name, fn in fns.items()})
    order = ["triton", "flashmla", *[name for name, _ in others], "torch bmm"]
    replays = {name: graphs[name].replay for name in order if name in graphs}
    times = _timing.interleaved_median_ms(replays)
    rows = []
    for name, (ms, spread) in times.items():
        bandwidth = problem.latent_bytes / (ms * 1e-3)
        rows.append(
            {
                "batch": problem.batch,
                "tokens": problem.tokens,
                "kernel": name,
                "us": ms * 1e3,
                "GB/s": bandwidth / 1e9,
                "of_copy": bandwidth / copy_bw,
                "TFLOP/s": problem.flops / (ms * 1e-3) / 1e12,
                "spread_%": spread,
                "config": configs.get(name, ""),
                "max_err": errors.get(name, float("nan")),
            }
        )
    ours = rows[0]
    for row in rows[1:]:
        ours["x " + row["kernel"].split()[-1]] = row["us"] / ours["us"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[1], help="query tokens a request (1 to 4)"
    )
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
    flash = flashmla_available()
    copy_bw = _timing.copy_bandwidth(device)
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows, best = [], []
    for tokens, batch in itertools.product(args.tokens, args.batches):
        step_spec = dataclasses.replace(spec, num_speculative_tokens=tokens - 1)
        problem = Problem(step_spec, batch, device, args.context)
        rows.extend(default_rows(problem, copy_bw, flash))
        if args.tune:
            best.extend(tuned_rows(problem, copy_bw))
        del problem
        torch.cuda.empty_cache()
    columns = ["batch", "tokens", "kernel", "us", "TFLOP/s", "GB/s", "of_copy", "spread_%"]
    peers = ["x flashmla", "x mma.sync", "x portable", "x bmm"]
    _timing.print_table([*columns, *peers, "config", "max_err"], rows)
    if best:
        print("\nbest launches (--tune):")
        _timing.print_table(["batch", "tokens", "config", "us", "TFLOP/s", "max_err"], best)
    suffix = "" if args.tokens == [1] else "_t" + "".join(map(str, args.tokens))
    _timing.write_json(
        f"mla_decode_h{args.heads}{suffix}"
        + ("" if args.context == CONTEXT else f"_c{args.context}"),
        {
            "problem": {
                "heads": args.heads,
                "kv_lora_rank": LATENT,
                "rope": ROPE,
                "context": args.context,
                "tokens": args.tokens,
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
