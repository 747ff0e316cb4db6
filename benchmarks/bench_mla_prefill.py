"""MLA prefill (triton provider, the MHA form) vs SDPA's backends, in TFLOP/s.

Problem: DeepSeek-V3 attention on one device of a tensor-parallel 8 deployment, in
prefill: 16 query heads, queries and keys 192 wide (128 + rope 64), values 128 wide,
causal, 8 requests x 2048 new tokens without cached context, bf16; the latent cache
(512 + rope 64) in pages of 64 tokens, permuted. ``--heads 128`` runs the whole
model's heads.

``attention`` rows take the same decompressed keys and values: ``triton`` is the
kernel the provider runs (on a Hopper GPU with Triton 3.6 the Gluon prefill over the
tokens' own rows), ``portable`` the portable kernel over the same rows; SDPA reads
them as contiguous ``[batch, heads, seq, width]`` tensors under torch's own choice
(``default``), cuDNN, FlashAttention-2 and the memory-efficient kernel (``n/a`` where
a backend refuses: flash takes only equal widths). FLOPs count the (query, key) pairs
the causal mask keeps, 2 x (192 + 128) per pair and head.
All attention kernels are timed in 3 interleaved rounds (median; ``spread_%``: the
rounds' max - min over it).

The ``layer`` row is ``mla_prefill`` as a model calls it (the tokens' latents read
from the cache, up-projected by a bf16 linear layer of 512 -> heads x 256, then the
attention) against the same gather and up-projection in torch followed by the run's
fastest SDPA backend, in ms.

    python benchmarks/bench_mla_prefill.py [--heads 16] [--batch 8] [--query-len 2048]
"""

from __future__ import annotations

import argparse
from typing import Any

import _timing  # first: puts the packages' src on sys.path
import torch
import torch.nn.functional as F
from _paged_batch import causal_pairs, permuted_block_tables

from npu_attention import plan
from npu_attention.mla import MLASpec, allocate_latent_cache, mla_prefill, mla_write_cache
from npu_attention.mla.run import up_projected_heads
from npu_attention.providers.triton import gluon_kernels
from npu_attention.providers.triton_kernels import paged_attention
from npu_attention.providers.triton_kernels.hopper_prefill import (
    hopper_prefill,
    hopper_prefill_supported,
)
from npu_attention.spec import AttentionSpec

LATENT, ROPE, NOPE, VALUE, BLOCK_SIZE, DTYPE = 512, 64, 128, 128, 64, torch.bfloat16
QK = NOPE + ROPE
SDPA_BACKENDS = (*_timing.SDPA_PEERS, "efficient")


class Problem:
    """``batch`` prefills of ``query_len`` tokens: a written latent cache, queries, the
    up-projection, and the decompressed keys and values (token rows and SDPA's layout)."""

    def __init__(self, heads: int, batch: int, query_len: int, device: torch.device) -> None:
        self.spec = MLASpec(
            num_heads=heads,
            kv_lora_rank=LATENT,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            v_head_dim=VALUE,
            block_size=BLOCK_SIZE,
            dtype=DTYPE,
        )
        self.heads, self.batch, self.query_len = heads, batch, query_len
        tokens = batch * query_len
        gen = torch.Generator(device=device).manual_seed(0)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(DTYPE)

        pages = -(-query_len // BLOCK_SIZE)
        tables = permuted_block_tables(batch, pages, torch.Generator().manual_seed(0), device)
        positions = torch.arange(query_len, device=device)
        slots = tables.long()[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        self.cache = allocate_latent_cache(1 + batch * pages, self.spec, device)
        self.step = plan(
            [i * query_len for i in range(batch + 1)],
            [query_len] * batch,
            tables,
            slots.reshape(-1),
            0,
            self.spec,
            provider="triton",
        )
        mla_write_cache(rand(tokens, LATENT), rand(tokens, ROPE), self.cache, self.step)
        self.weight = rand(heads * (NOPE + VALUE), LATENT, scale=LATENT**-0.5)
        self.query = rand(tokens, heads, QK)
        self.out = torch.empty(tokens, heads, VALUE, dtype=DTYPE, device=device)
        self.cu_seqlens = torch.arange(0, tokens + 1, query_len, device=device, dtype=torch.int32)
        self.seq_lens = torch.full((batch,), query_len, device=device, dtype=torch.int32)
        self.slots = slots.reshape(-1)
        self.keys, self.values = self.decompress()
        self.sdpa_inputs = [
            t.view(batch, query_len, heads, -1).transpose(1, 2).contiguous()
            for t in (self.query, self.keys, self.values)
        ]

    def kv_up_proj(self, kv_c: torch.Tensor) -> torch.Tensor:
        return F.linear(kv_c, self.weight)

    def decompress(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[tokens, heads, 192]`` and values ``[tokens, heads, 128]`` of the
        tokens' cached latents, as the provider builds them."""
        blocks, offsets = self.slots // BLOCK_SIZE, self.slots % BLOCK_SIZE
        kv_c, k_pe = self.cache.kv_c[blocks, offsets], self.cache.k_pe[blocks, offsets]
        k_nope, values = up_projected_heads(self.kv_up_proj, kv_c, self.spec)
        keys = torch.cat([k_nope, k_pe[:, None].expand(-1, self.heads, -1)], dim=-1)
        return keys, values.contiguous()

    @property
    def flops(self) -> int:
        pairs = self.batch * causal_pairs(self.query_len, self.query_len)
        return 2 * (QK + VALUE) * self.heads * pairs

    def as_rows(self, sdpa_out: torch.Tensor) -> torch.Tensor:
        return sdpa_out.transpose(1, 2).reshape(-1, self.heads, VALUE)

    def sdpa(self, backend: str):
        query, keys, values = self.sdpa_inputs

        def attend() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=self.spec.softmax_scale
            )

        return _peer_runner(backend, attend)

    def gluon(self):
        """The Gluon prefill over the rows, or ``None`` where it cannot run."""
        if gluon_kernels(self.query.device, "hopper_prefill") is None:
            return None
        if not hopper_prefill_supported(self.query, self.keys, self.values, self.out):
            return None
        scale = self.spec.softmax_scale

        def attend() -> torch.Tensor:
            hopper_prefill(
                self.query, self.keys, self.values, self.out, self.cu_seqlens, scale=scale
            )
            return self.out

        return attend

    def portable(self):
        """The portable kernel over the rows, at the provider's prefill launch."""
        spec = AttentionSpec(
            self.heads, self.heads, QK, block_size=BLOCK_SIZE, dtype=DTYPE,
            scale=self.spec.softmax_scale,
        )  # fmt: skip
        config = self.step.provider.attention.prefill_config(spec, paged=False)

        def attend() -> torch.Tensor:
            paged_attention(
                self.query, self.keys, self.values, self.out, self.cu_seqlens, self.seq_lens,
                None, config=config, decode_tiles=False, scale=self.spec.softmax_scale,
                paged=False,
            )  # fmt: skip
            return self.out

        return attend

    def layer(self) -> torch.Tensor:
        return mla_prefill(self.query, self.cache, self.step, self.kv_up_proj, self.out)

    def torch_layer(self, backend: str):
        def run() -> torch.Tensor:
            keys, values = self.decompress()
            query = self.query.view(self.batch, self.query_len, self.heads, QK).transpose(1, 2)
            shape = (self.batch, self.query_len, self.heads, -1)
            with _timing.sdpa_backend(backend):
                return F.scaled_dot_product_attention(
                    query,
                    keys.view(shape).transpose(1, 2),
                    values.view(shape).transpose(1, 2),
                    is_causal=True,
                    scale=self.spec.softmax_scale,
                )

        return _peer_runner("default", run)


def _peer_runner(backend: str, fn):
    """``fn`` under SDPA ``backend``, or ``None`` when it refuses (any error)."""
    try:
        return _timing.peer_runner(backend, fn)
    except Exception as failure:  # e.g. a backend that exists but fails on these widths
        print(f"{backend}: {type(failure).__name__}: {str(failure)[:100]}")
        return None


def attention_rows(problem: Problem) -> tuple[list[dict[str, Any]], str]:
    """Every kernel timed in interleaved rounds (a prefill holds the GPU at its power
    limit, so a kernel timed first, before the clock settles, would read faster)."""
    expected = problem.as_rows(problem.sdpa("default")()).float()
    kernels = {"triton": problem.gluon() or problem.portable(), "portable": problem.portable()}
    errors = {name: (run().float() - expected).abs().max().item() for name, run in kernels.items()}
    peers_run = {backend: problem.sdpa(backend) for backend in SDPA_BACKENDS}
    runnable = {name: run for name, run in {**kernels, **peers_run}.items() if run is not None}
    timed = _timing.interleaved_median_ms(runnable)
    times = {name: timed[name][0] if name in timed else None for name in runnable | peers_run}
    rows = [
        {"kernel": name, "ms": times[name], "spread_%": timed[name][1], "max_err": errors[name]}
        for name in kernels
    ]
    for backend in SDPA_BACKENDS:
        spread = timed[backend][1] if backend in timed else "n/a"
        rows.append(
            {"kernel": f"sdpa {backend}", "ms": times[backend] or "n/a", "spread_%": spread}
        )
    peers = {name: ms for name, ms in times.items() if name in SDPA_BACKENDS and ms is not None}
    best = min(peers, key=peers.get)
    for row in rows:
        if isinstance(row["ms"], float):
            row["TFLOP/s"] = problem.flops / (row["ms"] * 1e-3) / 1e12
            row["vs_best_sdpa"] = peers[best] / row["ms"]
    return rows, best


def layer_rows(problem: Problem, best: str) -> list[dict[str, Any]]:
    expected = problem.as_rows(problem.torch_layer(best)()).float()
    error = (problem.layer().float() - expected).abs().max().item()
    ours = _timing.median_ms(problem.layer)
    theirs = _timing.median_ms(problem.torch_layer(best))
    return [
        {"kernel": "mla_prefill", "ms": ours, "vs_torch": theirs / ours, "max_err": error},
        {"kernel": f"torch + sdpa {best}", "ms": theirs},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--query-len", type=int, default=2048)
    args = parser.parse_args()
    device = _timing.require_cuda()
    problem = Problem(args.heads, args.batch, args.query_len, device)
    rows, best = attention_rows(problem)
    layer = layer_rows(problem, best)
    print(f"attention ({args.batch} x {args.query_len}, {args.heads} heads, 192 / 128):")
    _timing.print_table(["kernel", "ms", "TFLOP/s", "vs_best_sdpa", "spread_%", "max_err"], rows)
    print("\nlayer (gather + up-projection + attention):")
    _timing.print_table(["kernel", "ms", "vs_torch", "max_err"], layer)
    _timing.write_json(
        f"mla_prefill_h{args.heads}",
        {
            "problem": {
                "heads": args.heads,
                "batch": args.batch,
                "query_len": args.query_len,
                "qk_head_dim": QK,
                "v_head_dim": VALUE,
                "block_size": BLOCK_SIZE,
                "dtype": str(DTYPE),
            },
            "environment": _timing.environment(device),
            "attention": rows,
            "best_sdpa": best,
            "layer": layer,
        },
    )


if __name__ == "__main__":
    main()
