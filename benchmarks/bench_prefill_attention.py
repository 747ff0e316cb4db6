"""Paged prefill attention (triton provider) vs SDPA's backends, in TFLOP/s.

Problems (32 query / 8 KV heads, head size 128, bf16, causal):
- ``prefill``: 8 requests x 2048 new tokens, no cached context;
- ``chunk_after_prefix``: one 512-token chunk after a 4096-token cached prefix
  (bottom-right causal: query ``i`` sees keys ``<= 4096 + i``).
The triton provider is called as ``npu_attention.run`` calls it, with the step's own
K/V rows beside the paged cache (permuted pages): a prefill without cached context reads
its keys from those rows (``triton``: on a Hopper GPU through the Gluon kernel), a chunk
after a prefix reads every key from the pages. ``portable`` is the same call with
``hopper_prefill`` off (the portable kernel on the same rows); ``pages`` is the call
without the rows: every key gathered from the pages.
SDPA (``enable_gqa=True``) reads contiguous ``[batch, kv_heads, seq, head_size]`` K/V.
FLOPs count only the (query, key) pairs the causal mask keeps, 4 * head_size per
pair and head, for both. Peers from the same run: SDPA with torch's own backend
choice (``default``; the kernels it launched are printed and kept in the JSON), and
restricted to cuDNN (``cudnn``) and FlashAttention-2 (``flash``); ``n/a`` where a
backend refuses the problem. Every call of a problem is timed in ``--rounds``
interleaved rounds (a prefill runs the GPU near its power limit, and the clock it
settles at differs from the first call's); ``spread_%`` is the largest spread of a
row's calls over the rounds.

With ``--kv-cache-dtype KIND`` only the 16-bit cache and the 8-bit cache of ``KIND``
are timed, each as a model's forward runs its layers: ``LAYERS`` layers in sequence, one
plan for the step, each layer with its own pages, the new tokens' K/V written into them
(quantized for ``KIND``), then attention; a row is one layer's share of the device
time, the launches queued ahead of the GPU as when the host runs ahead of a model
(``_timing.queued_median_ms``: ``bf16_ms``, ``kind_ms``, ``ratio`` = kind / bf16;
``in_kernel_ratio``: ``KIND`` with no page pool), and ``host_us`` the host time to
issue one layer of each. A prefill without cached context attends over its own rows
either way; a chunk after a prefix reads the pages, through the 16-bit page pool the
provider dequantizes them into once a layer where it takes one.

With ``--prefill-variants [NAMES]`` the chunk's attention alone, one call each: over
16-bit pages (``bf16``), over ``KIND``'s pages as the provider runs it (``default``),
converting in the kernel at the provider's 8-bit launch (``in_kernel``) and at each
launch of ``PREFILL_VARIANTS_8BIT``, and the write alone of each cache, timed the same
way (``bf16_graph``, ``in_kernel_graph``: CUDA-graph replays of those calls, a check
of the timer); ``--prefix N``
sets the chunk's cached prefix (default 4096), ``--query-len N`` its length (512).

    python benchmarks/bench_prefill_attention.py [--tune] [--rounds 3]
    python benchmarks/bench_prefill_attention.py --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
from typing import Any

import _timing  # first: puts the packages' src on sys.path
import torch
import torch.nn.functional as F
from _paged_batch import attention_flops, causal_pairs, hand_plan, page_kv, permuted_block_tables
from _quantized_pages import quantized_pages
from torch.nn.attention.bias import causal_lower_right

from npu_attention.providers.triton import TritonProvider
from npu_attention.spec import AttentionSpec

HEADS, KV_HEADS, HEAD_SIZE, DTYPE = 32, 8, 128, torch.bfloat16
PROBLEMS = {"prefill": (8, 2048, 0), "chunk_after_prefix": (1, 512, 4096)}
LAYERS = 8  # layers timed in sequence by --kv-cache-dtype


class PrefillProblem:
    """``batch`` requests of ``query_len`` new tokens after ``context`` cached ones."""

    def __init__(self, batch: int, query_len: int, context: int, device: torch.device) -> None:
        self.batch, self.query_len, self.seq_len = batch, query_len, query_len + context
        self.generator = torch.Generator().manual_seed(0)
        self.query = torch.randn(batch, HEADS, query_len, HEAD_SIZE, dtype=DTYPE, device=device)
        kv_shape = (batch, KV_HEADS, self.seq_len, HEAD_SIZE)
        self.key = torch.randn(kv_shape, dtype=DTYPE, device=device)
        self.value = torch.randn(kv_shape, dtype=DTYPE, device=device)

    @property
    def flops(self) -> int:
        pairs = self.batch * causal_pairs(self.query_len, self.seq_len)
        return attention_flops(HEADS, HEAD_SIZE, pairs)

    def sdpa_runner(self, backend: str = "default"):
        """SDPA under ``backend`` (``_timing.SDPA_PEERS``), or ``None`` if it refuses.

        K/V are read with ``enable_gqa=True``; a backend that refuses GQA (or the
        bottom-right causal mask with it) reads K/V expanded to all query heads.
        """
        if self.seq_len == self.query_len:
            options = {"is_causal": True}
        else:
            options = {"attn_mask": causal_lower_right(self.query_len, self.seq_len)}
        group = HEADS // KV_HEADS

        def variant(gqa: bool):
            if gqa:
                key, value = self.key, self.value
            else:
                key = self.key.repeat_interleave(group, dim=1)
                value = self.value.repeat_interleave(group, dim=1)
            return lambda: F.scaled_dot_product_attention(
                self.query, key, value, enable_gqa=gqa, **options
            )

        for gqa in (True, False):
            runner = _timing.peer_runner(backend, variant(gqa))
            if runner is not None:
                return runner
        return None

    def paged_runner(self, provider: TritonProvider, block_size: int, own_keys: bool = False):
        """``provider.attend`` over a paged cache; with ``own_keys``, also given the new
        tokens' K/V rows (``[tokens, kv_heads, head_size]``), as ``run`` gives them."""
        spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, block_size=block_size, dtype=DTYPE)
        pages = -(-self.seq_len // block_size)
        block_tables = permuted_block_tables(self.batch, pages, self.generator, self.key.device)
        padded = pages * block_size - self.seq_len
        key, value = (F.pad(t, (0, 0, 0, padded)) for t in (self.key, self.value))
        key_cache = page_kv(key, block_size, block_tables)
        value_cache = page_kv(value, block_size, block_tables)
        plan = hand_plan(
            spec, provider, [self.query_len] * self.batch, [self.seq_len] * self.batch,
            block_tables, num_decodes=0,
        )  # fmt: skip
        query = self.query.transpose(1, 2).reshape(-1, HEADS, HEAD_SIZE).contiguous()
        out = torch.empty_like(query)
        new_rows = {}
        if own_keys:
            for name, dense in (("key", self.key), ("value", self.value)):
                new = dense[:, :, self.seq_len - self.query_len :].transpose(1, 2)
                new_rows[name] = new.reshape(-1, KV_HEADS, HEAD_SIZE).contiguous()

        def run() -> torch.Tensor:
            provider.attend(query, key_cache, value_cache, plan, out, **new_rows)
            return out

        return run

    def layer_runner(
        self,
        provider: TritonProvider,
        block_size: int,
        kind: str = "auto",
        *,
        layers: int = 1,
        attend_only: bool = False,
        write_only: bool = False,
    ):
        """``layers`` layers in sequence as ``npu_attention.run`` runs each, under one
        plan: the new rows written into the layer's pages (8-bit pages of ``kind``
        unless ``auto``), then attention (``attend_only`` / ``write_only``: one of the
        two; the pages already hold the new rows). Returns the last layer's output."""
        spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, block_size=block_size, dtype=DTYPE,
                             kv_cache_dtype=kind)  # fmt: skip
        pages = -(-self.seq_len // block_size)
        block_tables = permuted_block_tables(self.batch, pages, self.generator, self.key.device)
        padded = pages * block_size - self.seq_len
        key, value = (F.pad(t, (0, 0, 0, padded)) for t in (self.key, self.value))
        caches = []
        for _ in range(layers):
            if kind == "auto":
                k_pages = page_kv(key, block_size, block_tables)
                caches.append((k_pages, page_kv(value, block_size, block_tables), {}))
            else:
                k_pages, v_pages, scales = quantized_pages(
                    key, value, block_size, block_tables, kind
                )
                caches.append((k_pages, v_pages, {"scales": scales}))
        plan = hand_plan(
            spec, provider, [self.query_len] * self.batch, [self.seq_len] * self.batch,
            block_tables, num_decodes=0,
        )  # fmt: skip
        positions = torch.arange(self.seq_len - self.query_len, self.seq_len, device=key.device)
        blocks = block_tables[:, positions // block_size].long()
        plan.slot_mapping = (blocks * block_size + positions % block_size).reshape(-1)
        query, rows = self.token_rows()
        out = torch.empty_like(query)

        def run() -> torch.Tensor:
            for key_cache, value_cache, extra in caches:
                if not attend_only:
                    provider.write_kv(rows[0], rows[1], key_cache, value_cache, plan, **extra)
                if not write_only:
                    provider.attend(
                        query, key_cache, value_cache, plan, out, rows[0], rows[1], **extra
                    )
            return out

        return run

    def token_rows(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step's query ``[tokens, heads, head_size]`` and its new key and value
        rows ``[tokens, kv_heads, head_size]``, token-major as ``attend`` takes them."""
        query = self.query.transpose(1, 2).reshape(-1, HEADS, HEAD_SIZE).contiguous()
        rows = []
        for dense in (self.key, self.value):
            new = dense[:, :, self.seq_len - self.query_len :].transpose(1, 2)
            rows.append(new.reshape(-1, KV_HEADS, HEAD_SIZE).contiguous())
        return query, rows

    def as_sdpa_layout(self, out: torch.Tensor) -> torch.Tensor:
        return out.view(self.batch, self.query_len, HEADS, HEAD_SIZE).transpose(1, 2)


def graph_replay(fn):
    """A replay of ``fn`` captured as one CUDA graph."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure(
    problem: PrefillProblem, provider: TritonProvider, block_size: int, own_keys: bool = False
) -> dict[str, Any]:
    run = checked_runner(problem, provider, block_size, own_keys)
    ms = _timing.median_ms(run)
    return {"ms": ms, "tflops": problem.flops / (ms * 1e-3) / 1e12, "max_abs_err": run.error}


def checked_runner(
    problem: PrefillProblem, provider: TritonProvider, block_size: int, own_keys: bool = False
):
    """``problem.paged_runner`` with its largest error against SDPA as ``.error``."""
    run = problem.paged_runner(provider, block_size, own_keys)
    expected = problem.sdpa_runner()().float()
    run.error = (problem.as_sdpa_layout(run()).float() - expected).abs().max().item()
    return run


def kv_cache_dtype_rows(device: torch.device, kind: str, rounds: int) -> list[dict[str, Any]]:
    """The 16-bit and the ``kind`` cache on every problem and block size, interleaved;
    ``in_kernel_ratio``: ``kind`` with no page pool (converted in the kernel)."""
    provider, in_kernel = TritonProvider(), TritonProvider()
    in_kernel.dequant_pool_bytes = 0
    rows = []
    for name, shape in PROBLEMS.items():
        problem = PrefillProblem(*shape, device)
        expected = problem.sdpa_runner()().float()
        for block_size in (128, 16):
            calls = {
                label: problem.layer_runner(chosen, block_size, cache, layers=LAYERS)
                for label, chosen, cache in (
                    ("bf16", provider, "auto"), (kind, provider, kind),
                    ("in_kernel", in_kernel, kind),
                )
            }  # fmt: skip
            errors = {
                label: (problem.as_sdpa_layout(run()).float() - expected).abs().max().item()
                for label, run in calls.items()
            }
            timed = _timing.interleaved_median_ms(calls, rounds, _timing.queued_median_ms)
            ms16, ms8 = timed["bf16"][0] / LAYERS, timed[kind][0] / LAYERS
            host = {label: _timing.host_issue_us(run) / LAYERS for label, run in calls.items()}
            rows.append({
                "problem": name, "block": block_size, "bf16_ms": ms16, "kind_ms": ms8,
                "ratio": ms8 / ms16, "in_kernel_ratio": timed["in_kernel"][0] / LAYERS / ms16,
                "kind_TFLOP/s": problem.flops / (ms8 * 1e-3) / 1e12,
                "spread_%": max(spread for _, spread in timed.values()),
                "bf16_err": errors["bf16"], "kind_err": errors[kind],
                "in_kernel_err": errors["in_kernel"],
                "host_us": "/".join(f"{host[label]:.0f}" for label in calls),
            })  # fmt: skip
        del problem
        torch.cuda.empty_cache()
    return rows


# ``--prefill-variants``: the portable kernel's launches for chunks over 8-bit pages
# (block_m, block_n, num_warps, num_stages; fast_dequant 1 or 0).
PREFILL_VARIANTS_8BIT = {
    "m128_n128_w8_s3": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    "m64_n128_w4_s2": {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2},
    "m64_n128_w4_s4": {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 4},
    "m64_n128_w8_s3": {"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 3},
    "m32_n128_w4_s3": {"block_m": 32, "block_n": 128, "num_warps": 4, "num_stages": 3},
    "m64_n128_w4_s3_fast": {
        "block_m": 64,
        "block_n": 128,
        "num_warps": 4,
        "num_stages": 3,
        "fast_dequant": 1,
    },
    "m64_n128_w4_s3_cvt": {
        "block_m": 64,
        "block_n": 128,
        "num_warps": 4,
        "num_stages": 3,
        "fast_dequant": 0,
    },
    "m128_n64_w8_s3": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
    "m128_n128_w8_s3_fast": {
        "block_m": 128,
        "block_n": 128,
        "num_warps": 8,
        "num_stages": 3,
        "fast_dequant": 1,
    },
    "m128_n128_w8_s3_cvt": {
        "block_m": 128,
        "block_n": 128,
        "num_warps": 8,
        "num_stages": 3,
        "fast_dequant": 0,
    },
    "m128_n128_w8_s2_fast": {
        "block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "fast_dequant": 1,
    },
    "m128_n64_w8_s2_fast": {
        "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2, "fast_dequant": 1,
    },
    "m128_n64_w8_s3_fast": {
        "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "fast_dequant": 1,
    },
    "m64_n128_w4_s1": {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 1},
    "m64_n64_w4_s2": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
}  # fmt: skip


def prefill_variant_rows(
    device: torch.device,
    kind: str,
    rounds: int,
    names: list[str] | None = None,
    prefix: int = PROBLEMS["chunk_after_prefix"][2],
    query_len: int = PROBLEMS["chunk_after_prefix"][1],
) -> list[dict[str, Any]]:
    """A ``query_len`` chunk after a ``prefix``-token prefix: attention alone (no
    write) over the 16-bit pages and over ``kind``'s pages as the provider runs it, in
    the kernel, and with each of ``PREFILL_VARIANTS_8BIT`` (``names``: those only),
    interleaved; and the write alone of each cache."""
    rows = []
    problem = PrefillProblem(PROBLEMS["chunk_after_prefix"][0], query_len, prefix, device)
    expected = problem.sdpa_runner()().float()
    for block_size in (128, 16):
        launches = {"default": TritonProvider(), "in_kernel": TritonProvider()}
        for name, launch in PREFILL_VARIANTS_8BIT.items():
            if names is None or name in names:
                launches[name] = TritonProvider()
                launches[name].prefill_launch_8bit = launch
        for name, provider in launches.items():
            if name != "default":
                provider.dequant_pool_bytes = 0  # convert in the kernel
        calls = {"bf16": problem.layer_runner(TritonProvider(), block_size, attend_only=True),
                 "bf16_write": problem.layer_runner(TritonProvider(), block_size,
                                                    write_only=True),
                 f"{kind}_write": problem.layer_runner(TritonProvider(), block_size, kind,
                                                       write_only=True)}  # fmt: skip
        for name, provider in launches.items():
            calls[name] = problem.layer_runner(provider, block_size, kind, attend_only=True)
        errors = {}
        for label, run in list(calls.items()):
            try:
                result = run()
            except Exception as error:  # e.g. out of shared memory
                print(f"skip {label}: {type(error).__name__}: {error}"[:300])
                del calls[label]
                continue
            if not label.endswith("_write"):
                errors[label] = (problem.as_sdpa_layout(result).float() - expected).abs().max()
        for label in ("bf16", "in_kernel"):  # the timer checked against graph replays
            calls[f"{label}_graph"] = graph_replay(calls[label])
        timed = _timing.interleaved_median_ms(calls, rounds, _timing.queued_median_ms)
        for label, (ms, spread) in timed.items():
            rows.append({
                "block": block_size, "call": label, "ms": ms,
                "vs_bf16": ms / timed["bf16"][0], "spread_%": spread,
                "max_err": float(errors[label]) if label in errors else "",
            })  # fmt: skip
    return rows


def tune(device: torch.device) -> dict[str, Any]:
    provider = TritonProvider()
    problem = PrefillProblem(*PROBLEMS["prefill"], device)
    trials = []
    # (block_m, block_n, num_warps, num_stages): one warpgroup per 64 query rows;
    # a 64-row tile of 4 warps leaves room for two programs per multiprocessor.
    shapes = (
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 128, 4, 2),
        (64, 64, 4, 2),
        (64, 64, 4, 3),
        (64, 128, 4, 2),
        (64, 128, 4, 3),
    )
    for block_m, block_n, warps, stages in shapes:
        launch = {
            "block_m": block_m,
            "block_n": block_n,
            "num_warps": warps,
            "num_stages": stages,
        }
        provider.prefill_launch = provider.prefill_launch_small_pages = launch
        try:
            result = measure(problem, provider, 128)
            result16 = measure(problem, provider, 16)
        except Exception as error:  # e.g. out of shared memory
            print(f"skip {launch}: {type(error).__name__}")
            continue
        trials.append({**launch, "tflops": result["tflops"], "tflops_bs16": result16["tflops"]})
        print(trials[-1])
    keys = ("block_m", "block_n", "num_warps", "num_stages")
    best = max(trials, key=lambda t: t["tflops"])
    best16 = max(trials, key=lambda t: t["tflops_bs16"])
    return {
        "launch": {k: best[k] for k in keys},
        "launch_small_pages": {k: best16[k] for k in keys},
        "trials": trials,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true", help="sweep launch parameters first")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument(
        "--once", action="store_true", help="run the 8 x 2048 problem once (for a profiler)"
    )
    parser.add_argument(
        "--kv-cache-dtype", help="only this 8-bit cache kind against the 16-bit cache"
    )
    parser.add_argument(
        "--prefill-variants",
        nargs="?",
        const="all",
        help="with --kv-cache-dtype: the chunk's attention under each 8-bit launch "
        "(or those named, comma-separated)",
    )
    parser.add_argument(
        "--prefix",
        type=int,
        default=PROBLEMS["chunk_after_prefix"][2],
        help="with --prefill-variants: the chunk's cached prefix in tokens",
    )
    parser.add_argument(
        "--query-len",
        type=int,
        default=PROBLEMS["chunk_after_prefix"][1],
        help="with --prefill-variants: the chunk's length in tokens",
    )
    args = parser.parse_args()
    device = _timing.require_cuda()
    if args.kv_cache_dtype and args.prefill_variants:
        names = None if args.prefill_variants == "all" else args.prefill_variants.split(",")
        kind = args.kv_cache_dtype
        rows = prefill_variant_rows(device, kind, args.rounds, names, args.prefix, args.query_len)
        print(f"kv_cache_dtype={kind}, {args.query_len} after {args.prefix} on "
              f"{torch.cuda.get_device_name(device)}")  # fmt: skip
        _timing.print_table(list(rows[0]), rows)
        name = f"prefill_variants_{kind}"
        if args.prefix != PROBLEMS["chunk_after_prefix"][2]:
            name += f"_prefix{args.prefix}"
        if args.query_len != PROBLEMS["chunk_after_prefix"][1]:
            name += f"_chunk{args.query_len}"
        _timing.write_json(name, {"prefix": args.prefix, "query_len": args.query_len, "rows": rows})
        return
    if args.kv_cache_dtype:
        rows = kv_cache_dtype_rows(device, args.kv_cache_dtype, args.rounds)
        print(f"kv_cache_dtype={args.kv_cache_dtype} on {torch.cuda.get_device_name(device)}")
        _timing.print_table(list(rows[0]), rows)
        _timing.write_json(f"prefill_{args.kv_cache_dtype}", {"rows": rows})
        return
    if args.once:
        problem = PrefillProblem(*PROBLEMS["prefill"], device)
        problem.paged_runner(TritonProvider(), 128, own_keys=True)()
        problem.sdpa_runner()()
        torch.cuda.synchronize()
        return
    provider = TritonProvider()
    tuning = tune(device) if args.tune else None
    if tuning:
        provider.prefill_launch = tuning["launch"]
        provider.prefill_launch_small_pages = tuning["launch_small_pages"]
    portable = TritonProvider()
    portable.hopper_prefill = False
    portable.prefill_launch = provider.prefill_launch
    portable.prefill_launch_small_pages = provider.prefill_launch_small_pages
    rows, default_kernels = [], {}
    for name, shape in PROBLEMS.items():
        problem = PrefillProblem(*shape, device)
        calls = {}
        for backend in _timing.SDPA_PEERS:
            runner = problem.sdpa_runner(backend)
            if runner is not None:
                calls[backend] = runner
        default_kernels[name] = _timing.kernel_names(calls["default"])
        print(f"{name}: SDPA's default launched {default_kernels[name]}")
        for block_size in (128, 16):
            calls[f"triton {block_size}"] = checked_runner(problem, provider, block_size, True)
            calls[f"pages {block_size}"] = checked_runner(problem, provider, block_size)
            calls[f"portable {block_size}"] = checked_runner(problem, portable, block_size, True)
        timed = _timing.interleaved_median_ms(calls, args.rounds)
        peers = {backend: timed[backend][0] if backend in timed else None
                 for backend in _timing.SDPA_PEERS}  # fmt: skip
        best = min(ms for ms in peers.values() if ms is not None)
        for block_size in (128, 16):
            ms = timed[f"triton {block_size}"][0]
            labels = ("triton", "portable", "pages")
            row = {
                "problem": name,
                "block": block_size,
                "triton_ms": ms,
                **{f"{label}_TFLOP/s": problem.flops / (timed[f"{label} {block_size}"][0]
                                                       * 1e-3) / 1e12 for label in labels},
            }  # fmt: skip
            for backend, peer_ms in peers.items():
                tflops = problem.flops / (peer_ms * 1e-3) / 1e12 if peer_ms is not None else None
                row[f"{backend}_TFLOP/s"] = tflops if tflops is not None else "n/a"
                row[f"vs_{backend}"] = peer_ms / ms if peer_ms is not None else "n/a"
            row["vs_best_sdpa"] = best / ms
            row["max_err"] = max(calls[f"{label} {block_size}"].error for label in labels)
            row["spread_%"] = max(
                spread for call, (_, spread) in timed.items()
                if call in peers or call.endswith(f" {block_size}")
            )  # fmt: skip
            rows.append(row)
        del problem, calls
        torch.cuda.empty_cache()
    _timing.print_table(list(rows[0]), rows)
    _timing.write_json(
        "prefill_attention",
        {
            "environment": _timing.environment(device),
            "provider_settings": {
                "prefill_launch": provider.prefill_launch,
                "prefill_launch_small_pages": provider.prefill_launch_small_pages,
            },
            "sdpa_default_kernels": default_kernels,
            "rounds": args.rounds,
            "tuning": tuning,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
