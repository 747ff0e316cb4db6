"""The Hopper (Gluon) prefill kernel beside the portable Triton kernel and SDPA.

Checks each kernel against SDPA (float32 reference) on several batches, then times
8 x 2048 causal (32 / 8 heads, head size 128, bf16) for the Hopper kernel at 2 and 3
stages, the portable kernel on the same contiguous rows, and SDPA's cuDNN / flash.

    python benchmarks/bench_hopper_prefill.py [--variants all] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import _timing  # first: puts the packages' src on sys.path
import torch
import torch.nn.functional as F

from npu_attention.providers.triton_kernels.hopper_prefill import (
    hopper_prefill,
    hopper_prefill_supported,
)
from npu_attention.providers.triton_kernels.paged_attention import (
    AttentionLaunchConfig,
    paged_attention,
)

PORTABLE = AttentionLaunchConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


def packed(lens, heads, kv_heads, head_size, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, heads, head_size, generator=g).to(device, dtype)
    k = torch.randn(total, kv_heads, head_size, generator=g).to(device, dtype)
    v = torch.randn(total, kv_heads, head_size, generator=g).to(device, dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def reference(q, k, v, cu, causal, scale):
    outs, lses = [], []
    group = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qq = q[s:e].float().transpose(0, 1)
        kk = k[s:e].float().transpose(0, 1).repeat_interleave(group, 0)
        vv = v[s:e].float().transpose(0, 1).repeat_interleave(group, 0)
        scores = qq @ kk.transpose(1, 2) * scale
        if causal:
            n = e - s
            scores = scores.masked_fill(
                torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
        lses.append(torch.logsumexp(scores, -1).transpose(0, 1))
        outs.append((scores.softmax(-1) @ vv).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def check(device, names):
    """Each variant in ``names`` against the float32 reference, output and LSE."""
    cases = [
        ([2048] * 2, 32, 8, 128, torch.bfloat16, True),
        ([1, 17, 128, 129, 300, 1000], 32, 8, 128, torch.bfloat16, True),
        ([1, 17, 128, 129, 300, 1000], 32, 8, 128, torch.float16, False),
        ([5, 64, 200, 511], 16, 16, 64, torch.bfloat16, True),
        ([5, 64, 200, 511], 8, 2, 256, torch.bfloat16, True),
        ([333, 77], 28, 4, 128, torch.float16, True),
    ]
    worst = 0.0
    for lens, heads, kv_heads, head_size, dtype, causal in cases:
        q, k, v, cu = packed(lens, heads, kv_heads, head_size, dtype, device)
        assert hopper_prefill_supported(q, k, v, q), (lens, heads, head_size)
        scale = head_size**-0.5
        ref, ref_lse = reference(q, k, v, cu, causal, scale)
        for name in names:
            out = torch.full_like(q, float("nan"))
            lse = torch.full((q.shape[0], heads), float("nan"), device=device)
            hopper_prefill(q, k, v, out, cu, scale=scale, causal=causal, lse=lse, **VARIANTS[name])
            err = (out.float() - ref).abs().max().item()
            lse_err = (lse - ref_lse).abs().max().item()
            ok = err < 2e-2 and lse_err < 1e-3
            print(
                f"check lens={lens} heads={heads}/{kv_heads} d={head_size} {dtype} causal={causal} "
                f"{name}: max err {err:.2e}, lse err {lse_err:.2e} {'ok' if ok else 'FAIL'}"
            )
            worst = max(worst, err)
    return worst


# Launch variants of the Hopper kernel timed side by side (keyword arguments of
# ``hopper_prefill``); ``--variants all`` times every one.
VARIANTS = {
    "default": {},
    "3_stages": {"stages": 3},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="default", help="comma-separated, or 'all'")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    args = parser.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    device = _timing.require_cuda()
    check(device, names)
    batch, n, heads, kv_heads, head_size = 8, 2048, 32, 8, 128
    q, k, v, cu = packed([n] * batch, heads, kv_heads, head_size, torch.bfloat16, device)
    scale = head_size**-0.5
    flops = 4 * batch * heads * head_size * n * (n + 1) / 2
    out = torch.empty_like(q)
    seq = torch.full((batch,), n, dtype=torch.int32, device=device)
    kernels = {
        f"hopper {name}": functools.partial(
            hopper_prefill, q, k, v, out, cu, scale=scale, **VARIANTS[name]
        )
        for name in names
    }
    kernels["portable 128x128"] = functools.partial(
        paged_attention, q, k, v, out, cu, seq, None, config=PORTABLE, decode_tiles=False,
        scale=scale, paged=False,
    )  # fmt: skip
    qs = q.view(batch, n, heads, head_size).transpose(1, 2)
    ks = k.view(batch, n, kv_heads, head_size).transpose(1, 2)
    vs = v.view(batch, n, kv_heads, head_size).transpose(1, 2)
    for backend in _timing.SDPA_PEERS:
        runner = _timing.peer_runner(
            backend,
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
        )
        if runner is not None:
            kernels[f"sdpa {backend}"] = runner
    times = {name: [] for name in kernels}
    for _ in range(args.rounds):  # interleaved, so that clock drift hits every kernel alike
        for name, fn in kernels.items():
            times[name].append(_timing.median_ms(fn))
    cudnn = statistics.median(times.get("sdpa cudnn", [float("nan")]))
    rows = []
    for name, samples in times.items():
        ms = statistics.median(samples)
        rows.append(
            {
                "kernel": name,
                "ms": ms,
                "TFLOP/s": flops / (ms * 1e-3) / 1e12,
                "vs_cudnn": cudnn / ms,
                "spread_%": 100 * (max(samples) - min(samples)) / ms,
            }
        )
    _timing.print_table(list(rows[0]), rows)
    _timing.write_json("hopper_prefill", {"environment": _timing.environment(device), "rows": rows})


if __name__ == "__main__":
    main()
