"""Paged decode attention (triton provider) vs SDPA on contiguous K/V, and vs copy bandwidth.

Problem: 32 query / 8 KV heads, head size 128, bf16; batch 1, 16, 64, 256 x context
512, 4096, 16384; paged caches of block size 128 and 16 over permuted pages.
Effective bandwidth = bytes of K and V read / time. Baselines measured in the
same run: a device-to-device copy (bytes read + written) and
``torch.nn.functional.scaled_dot_product_attention`` on the same data laid out
contiguously as ``[batch, kv_heads, context, head_size]``, with torch's own backend
choice (``default``) and restricted to cuDNN (``cudnn``) and FlashAttention-2
(``flash``); each peer is the faster of ``enable_gqa=True`` and the query heads of a
KV head packed as rows of one query (``n/a``: the backend refused both).
Both are timed as CUDA-graph replays (no host launch overhead; decode runs that
way in serving), the L2 cache cleared before each replay. For batches up to 16, two
kernel-only times (``_kernel_time``) follow for triton and the SDPA peers: ``*_kernel_us``,
the profiler's kernel durations summed per call (L2 cleared before each), and
``*_amortized_us``, one graph of 32 calls over 5 copies of the data (more than the L2
holds), per call: the graph's launch floor shared by the calls.

``triton_us`` is the provider as a user gets it: on a Hopper GPU with Triton 3.6, the
Gluon decode kernel (``hopper_decode``); ``portable_us`` is the same provider with
``hopper_decode`` off (the portable kernel), timed in the same run.

With ``--kv-cache-dtype KIND`` (``fp8``, ``fp8_e4m3``, ``int8_per_token_head``,
``fp8_per_token_head``) only the 8-bit cache is timed against the 16-bit cache, at
16 x 16384 and 64 x 4096 (block sizes 16 and 128), in interleaved rounds of CUDA-graph
replays: ``bf16_us`` is the provider as a user gets it (the Gluon decode on Hopper
where the programs fit one wave, else the portable kernel), ``kind_us`` the same
provider over 8-bit pages (on Hopper the Gluon decode, dequantizing in registers),
``speedup`` their ratio, both caches' pages in the row's order (``pages``: token-major
``[num_blocks, block_size, kv_heads, head_size]``, or head-major: each KV head's
tokens of a page contiguous, scales too); both errors are against SDPA on the 16-bit
K/V. ``--kv-variants`` (default: both orders at the provider's settings) times other
settings of the 8-bit decode (``KV_DTYPE_VARIANTS``: the Gluon decode's rings and
warps, one wave only, the portable kernel with and without the arithmetic
conversion, per-token-head scales laid head-major) in the same rounds.

    python benchmarks/bench_decode_attention.py [--tune] [--quick] [--hopper]
    python benchmarks/bench_decode_attention.py --kv-cache-dtype int8_per_token_head \
        [--kv-variants default,gluon_1cta,portable]
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import _timing  # first: puts the packages' src on sys.path
import torch
import torch.nn.functional as F
from _kernel_time import amortized_graph_us, profiled_kernel_us
from _paged_batch import hand_plan, page_kv, permuted_block_tables
from _quantized_pages import quantized_pages

from npu_attention.kv_quant import KVScales
from npu_attention.providers.triton import TritonProvider
from npu_attention.spec import AttentionSpec

HEADS, KV_HEADS, HEAD_SIZE, DTYPE = 32, 8, 128, torch.bfloat16
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 16384)
BLOCK_SIZES = (128, 16)
KERNEL_TIME_MAX_BATCH = 16  # kernel-only times for batches up to this (5 copies of the data)
KERNEL_TIME_PEERS = ("default", "cudnn")
KV_DTYPE_SHAPES = ((16, 16384), (64, 4096))  # (batch, context) of --kv-cache-dtype


class DecodeProblem:
    """Query and dense K/V of one (batch, context); paged copies made on demand."""

    def __init__(self, batch: int, context: int, device: torch.device, seed: int = 0) -> None:
        self.batch, self.context = batch, context
        self.generator = torch.Generator().manual_seed(seed)
        shape = (batch, KV_HEADS, context, HEAD_SIZE)
        self.query = torch.randn(batch, HEADS, HEAD_SIZE, dtype=DTYPE, device=device)
        self.key = torch.randn(shape, dtype=DTYPE, device=device)
        self.value = torch.randn(shape, dtype=DTYPE, device=device)

    @property
    def kv_bytes(self) -> int:
        return 2 * self.key.numel() * self.key.element_size()

    def sdpa(self) -> torch.Tensor:
        q = self.query.unsqueeze(2)  # [batch, heads, 1, d]
        out = F.scaled_dot_product_attention(q, self.key, self.value, enable_gqa=True)
        return out.squeeze(2)

    def sdpa_packed(self) -> torch.Tensor:
        """The query heads of each KV head as a 4-row query (no GQA support needed)."""
        q = self.query.view(self.batch, KV_HEADS, HEADS // KV_HEADS, HEAD_SIZE)
        out = F.scaled_dot_product_attention(q, self.key, self.value)
        return out.view(self.batch, HEADS, HEAD_SIZE)

    def peer_ms(self, backend: str) -> float | None:
        """Graph-replay time of SDPA under ``backend``: the faster of ``enable_gqa`` and
        packed query heads; ``None`` when the backend refuses both."""
        times = []
        for fn in (self.sdpa, self.sdpa_packed):
            runner = _timing.peer_runner(backend, fn)
            if runner is not None:
                times.append(_timing.graph_median_ms(runner))
        return min(times) if times else None

    def best_peer_ms(self) -> float:
        """The fastest of the SDPA peers (``_timing.SDPA_PEERS``) that take the problem."""
        return min(ms for ms in (self.peer_ms(b) for b in _timing.SDPA_PEERS) if ms is not None)

    def paged_runner(self, provider: TritonProvider, block_size: int, head_major: bool = False):
        """``provider.attend`` over 16-bit pages of ``block_size``, laid token-major
        (``[num_blocks, block_size, kv_heads, head_size]``) or ``head_major`` (each KV
        head's tokens of a page contiguous; the same logical tensor)."""
        spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, block_size=block_size, dtype=DTYPE)
        block_tables = permuted_block_tables(
            self.batch, self.context // block_size, self.generator, self.key.device
        )
        key_cache = page_kv(self.key, block_size, block_tables)
        value_cache = page_kv(self.value, block_size, block_tables)
        if head_major:
            key_cache, value_cache = (_head_major_pages(c) for c in (key_cache, value_cache))
        plan = hand_plan(
            spec, provider, [1] * self.batch, [self.context] * self.batch, block_tables,
            num_decodes=self.batch,
        )  # fmt: skip
        out = torch.empty_like(self.query)

        def run() -> torch.Tensor:
            provider.attend(self.query, key_cache, value_cache, plan, out)
            return out

        return run, plan


# Settings of the provider's decodes over 8-bit pages timed by --kv-cache-dtype (its
# TritonProvider attributes); "default" keeps the 16-bit settings.
_WIDE = {"block_n": 128, "num_warps": 4, "num_stages": 2, "pdl": 1, "prefetch_tiles": 1}
_WIDE_ONE_WAVE = {"block_n": 256, "num_warps": 8, "num_stages": 2, "pdl": 1, "prefetch_tiles": 1}
_DEEP = {"block_n": 128, "num_warps": 4, "num_stages": 4, "pdl": 1, "prefetch_tiles": 1}
KV_CACHE_KINDS = ("fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head")
SCALE_LAYOUT = "scale_layout"  # a variant's key that is no provider attribute


KV_DTYPE_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "wide": {"decode_launch_8bit": _WIDE, "decode_launch_one_wave_8bit": _WIDE_ONE_WAVE},
    "split": {"min_unsplit_fill_8bit": 8.0},
    "wide_split": {"decode_launch_8bit": _WIDE, "decode_launch_one_wave_8bit": _WIDE_ONE_WAVE,
                   "min_unsplit_fill_8bit": 8.0},
    "deep": {"decode_launch_8bit": _DEEP, "decode_launch_one_wave_8bit": _DEEP},
    "deep_split": {"decode_launch_8bit": _DEEP, "decode_launch_one_wave_8bit": _DEEP,
                   "min_unsplit_fill_8bit": 8.0},
    "wide_split4": {"decode_launch_8bit": _WIDE, "decode_launch_one_wave_8bit": _WIDE_ONE_WAVE,
                    "min_unsplit_fill_8bit": 8.0, "target_waves_8bit": 4},
    # The Gluon decode over 8-bit pages (the default: 64-key tiles, 2 stages, 4 warps,
    # 80 registers a thread, splits for 3 programs a multiprocessor; fp8 decodes of more
    # programs than multiprocessors with 128-key tiles and 128 registers) and the
    # alternatives measured; the portable kernel converting fp8 by arithmetic and int8 by
    # conversion instructions (the default), or either for both.
    "gluon_1cta": {"hopper_decode_programs_per_sm_8bit": 1, "hopper_decode_launch_8bit":
                   {"block_n": 128, "num_warps": 4, "num_stages": 4}},
    "gluon_1cta_w8": {"hopper_decode_programs_per_sm_8bit": 1, "hopper_decode_launch_8bit":
                      {"block_n": 128, "num_warps": 8, "num_stages": 4}},
    "gluon_2cta": {"hopper_decode_programs_per_sm_8bit": 2, "hopper_decode_launch_8bit":
                   {"block_n": 128, "num_warps": 4, "num_stages": 2, "maxnreg": 128}},
    "gluon_2cta_n64": {"hopper_decode_programs_per_sm_8bit": 2, "hopper_decode_launch_8bit":
                       {"block_n": 64, "num_warps": 4, "num_stages": 4, "maxnreg": 128}},
    "gluon_3cta_s3": {"hopper_decode_launch_8bit":
                      {"block_n": 64, "num_warps": 4, "num_stages": 3, "maxnreg": 80}},
    "gluon_3cta_s4": {"hopper_decode_launch_8bit":
                      {"block_n": 64, "num_warps": 4, "num_stages": 4, "maxnreg": 80}},
    "gluon_4cta": {"hopper_decode_programs_per_sm_8bit": 4, "hopper_decode_launch_8bit":
                   {"block_n": 64, "num_warps": 4, "num_stages": 2, "maxnreg": 64}},
    "gluon_mw_all": {"hopper_decode_multi_wave_8bit": KV_CACHE_KINDS},
    "gluon_mw_none": {"hopper_decode_multi_wave_8bit": ()},
    "gluon_mw_3cta": {"hopper_decode_multi_wave_8bit": KV_CACHE_KINDS,
                      "hopper_decode_launch_multi_wave_8bit":
                      {"block_n": 64, "num_warps": 4, "num_stages": 2, "maxnreg": 80}},
    "portable": {"hopper_decode_8bit": False},
    "portable_cvt": {"hopper_decode_8bit": False, "fast_dequant_pages": ()},
    "portable_fast": {"hopper_decode_8bit": False,
                      "fast_dequant_pages": (torch.int8, torch.float8_e4m3fn)},
    # The default launch over per-token-head scales laid head-major (each KV head's scales
    # of a page contiguous, as the bridge's "planes" split lays them) instead of the
    # benchmark's token-major [num_blocks, block_size, num_kv_heads].
    "head_major_scales": {SCALE_LAYOUT: "head_major"},
    "portable_head_major_pages": {SCALE_LAYOUT: "head_major_pages", "hopper_decode_8bit": False},
    # Pages and scales head-major (vLLM's HND page order: each KV head's tokens of a page
    # contiguous), against the 16-bit cache laid the same way.
    "head_major_pages": {SCALE_LAYOUT: "head_major_pages"},
    "portable_head_major_scales": {SCALE_LAYOUT: "head_major", "hopper_decode_8bit": False},
}  # fmt: skip


def quantized_pages_of(problem: DecodeProblem, block_size: int, kind: str):
    """The problem's K/V as 8-bit pages of ``kind``: ``(block_tables, key_cache,
    value_cache, scales, bytes)``."""
    block_tables = permuted_block_tables(
        problem.batch, problem.context // block_size, problem.generator, problem.key.device
    )
    key_cache, value_cache, scales = quantized_pages(
        problem.key, problem.value, block_size, block_tables, kind
    )
    nbytes = sum(t.numel() * t.element_size() for t in (key_cache, value_cache, *scales))
    return block_tables, key_cache, value_cache, scales, nbytes


def _head_major_pages(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` ``[num_blocks, block_size, kv_heads, ...]`` (same values) with each KV
    head's tokens of a page contiguous."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def head_major(scales: KVScales) -> KVScales:
    """Per-token-head ``scales`` (same values) with each KV head's scales of a page
    contiguous; per-tensor scales as they are."""
    if scales.k.dim() != 3:
        return scales
    return KVScales(*(_head_major_pages(s) for s in scales))


def quantized_runner(problem: DecodeProblem, provider: TritonProvider, pages, kind: str,
                     scale_layout: str = "token_major"):  # fmt: skip
    """``provider.attend`` over ``pages`` (``quantized_pages_of``), the per-token-head
    scales laid ``token_major`` (as made) or ``head_major``."""
    block_tables, key_cache, value_cache, scales, _ = pages
    if scale_layout in ("head_major", "head_major_pages"):
        scales = head_major(scales)
    if scale_layout == "head_major_pages":
        key_cache, value_cache = (_head_major_pages(c) for c in (key_cache, value_cache))
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, block_size=key_cache.shape[1], dtype=DTYPE,
                         kv_cache_dtype=kind)  # fmt: skip
    plan = hand_plan(
        spec, provider, [1] * problem.batch, [problem.context] * problem.batch, block_tables,
        num_decodes=problem.batch,
    )  # fmt: skip
    out = torch.empty_like(problem.query)

    def run() -> torch.Tensor:
        provider.attend(problem.query, key_cache, value_cache, plan, out, scales=scales)
        return out

    return run, plan


def _captured(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kv_cache_dtype_rows(
    device: torch.device, kind: str, rounds: int, variants: list[str]
) -> list[dict[str, Any]]:
    """The ``kind`` cache under each of ``variants`` (``KV_DTYPE_VARIANTS``) against the
    16-bit cache in the same page order (``pages``: token-major, or head-major for the
    ``head_major_pages`` variants) at ``KV_DTYPE_SHAPES``, interleaved graph replays."""
    rows = []
    for (batch, context), block_size in itertools.product(KV_DTYPE_SHAPES, BLOCK_SIZES):
        problem = DecodeProblem(batch, context, device)
        expected = problem.sdpa().float()
        pages = quantized_pages_of(problem, block_size, kind)
        order = {name: _page_order_of(name) for name in variants}
        runs, splits = {}, {}
        for page_order in sorted(set(order.values())):
            head_major = page_order == "head_major"
            runs[page_order], _ = problem.paged_runner(TritonProvider(), block_size, head_major)
        for name in variants:
            provider = TritonProvider()
            settings = dict(KV_DTYPE_VARIANTS[name])
            scale_layout = settings.pop(SCALE_LAYOUT, "token_major")
            for attribute, value in settings.items():
                setattr(provider, attribute, value)
            runs[name], plan = quantized_runner(problem, provider, pages, kind, scale_layout)
            splits[name] = plan.provider_data.num_kv_splits
        errors = {name: (run().float() - expected).abs().max().item() for name, run in runs.items()}
        graphs = {name: _captured(run) for name, run in runs.items()}
        times = _timing.interleaved_median_ms({k: g.replay for k, g in graphs.items()}, rounds)
        for name in variants:
            us16, us = times[order[name]][0] * 1e3, times[name][0] * 1e3
            rows.append({
                "batch": batch, "context": context, "block": block_size, "variant": name,
                "pages": order[name], "splits": splits[name], "bf16_us": us16, "kind_us": us,
                "speedup": us16 / us, "bf16_GB/s": problem.kv_bytes / (us16 * 1e-6) / 1e9,
                "kind_GB/s": pages[4] / (us * 1e-6) / 1e9,
                "spread_%": max(times[order[name]][1], times[name][1]),
                "bf16_err": errors[order[name]], "kind_err": errors[name],
            })  # fmt: skip
        del problem, graphs, runs, pages
        torch.cuda.empty_cache()
    return rows


def _page_order_of(variant: str) -> str:
    layout = KV_DTYPE_VARIANTS[variant].get(SCALE_LAYOUT)
    return "head_major" if layout == "head_major_pages" else "token_major"


def measure(
    problem: DecodeProblem,
    provider: TritonProvider,
    block_size: int,
    expected: torch.Tensor | None = None,
) -> dict[str, Any]:
    run, plan = problem.paged_runner(provider, block_size)
    expected = problem.sdpa().float() if expected is None else expected
    error = (run().float() - expected).abs().max().item()
    ms = _timing.graph_median_ms(run)
    return {"ms": ms, "max_abs_err_vs_sdpa": error, "kv_splits": plan.provider_data.num_kv_splits}


def sweep_row(
    problem: DecodeProblem,
    block_size: int,
    setting: dict[str, Any],
    result: dict[str, Any],
    best_sdpa_ms: float,
) -> dict[str, Any]:
    """One row of a settings sweep: the problem, the setting, its time beside the best
    SDPA peer's."""
    return {
        "batch": problem.batch, "context": problem.context, "block": block_size, **setting,
        "splits": result["kv_splits"], "us": result["ms"] * 1e3,
        "best_sdpa_us": best_sdpa_ms * 1e3, "vs_best_sdpa": best_sdpa_ms / result["ms"],
        "max_err": result["max_abs_err_vs_sdpa"],
    }  # fmt: skip


def tune(device: torch.device) -> dict[str, Any]:
    """Sweep the decode launch parameters on the target shapes; return the best."""
    provider = TritonProvider()
    big = DecodeProblem(64, 4096, device)
    trials = []
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4), (2, 3)):
        provider.decode_launch = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
        try:
            ms = measure(big, provider, 128)["ms"]
            ms16 = measure(big, provider, 16)["ms"]
        except Exception as error:  # e.g. out of shared memory
            print(f"skip block_n={block_n} warps={warps} stages={stages}: {error}")
            continue
        trials.append({**provider.decode_launch, "ms_bs128": ms, "ms_bs16": ms16})
        print(trials[-1])
    best = min(trials, key=lambda t: t["ms_bs128"] + t["ms_bs16"])
    provider.decode_launch = {k: best[k] for k in ("block_n", "num_warps", "num_stages")}
    del big
    small = DecodeProblem(1, 4096, device)
    mid = DecodeProblem(16, 4096, device)
    split_trials = []
    for min_tokens, waves in itertools.product((64, 128, 256, 512), (1, 2, 4)):
        provider.min_tokens_per_split, provider.target_waves = min_tokens, waves
        row = {
            "min_tokens_per_split": min_tokens,
            "target_waves": waves,
            "ms_b1": measure(small, provider, 128)["ms"],
            "ms_b16": measure(mid, provider, 128)["ms"],
        }
        split_trials.append(row)
        print(row)
    best_split = min(
        split_trials,
        key=lambda t: (
            t["ms_b1"] / split_trials[0]["ms_b1"] + t["ms_b16"] / split_trials[0]["ms_b16"]
        ),
    )
    return {
        "launch": provider.decode_launch,
        "min_tokens_per_split": best_split["min_tokens_per_split"],
        "target_waves": best_split["target_waves"],
        "launch_trials": trials,
        "split_trials": split_trials,
    }


def pdl_sweep(device: torch.device) -> list[dict[str, Any]]:
    """The provider's own choices with and without programmatic dependent launch
    (``pdl``), block sizes 128 and 16."""
    rows = []
    for batch, context in ((1, 512), (1, 4096), (16, 512), (16, 4096), (64, 4096)):
        problem = DecodeProblem(batch, context, device)
        expected = problem.sdpa().float()
        best_sdpa = problem.best_peer_ms()
        for block_size, pdl in itertools.product(BLOCK_SIZES, (0, 1)):
            provider = TritonProvider()
            for name in ("decode_launch", "decode_launch_one_wave"):
                setattr(provider, name, {**getattr(provider, name), "pdl": pdl})
            result = measure(problem, provider, block_size, expected)
            rows.append(sweep_row(problem, block_size, {"pdl": pdl}, result, best_sdpa))
        del problem
        torch.cuda.empty_cache()
    _timing.print_table(list(rows[0]), rows)
    return rows


def sweep(device: torch.device) -> list[dict[str, Any]]:
    """Time every (launch, KV splits) pair on the latency-bound shapes (block size 128)."""
    rows = []
    shapes = {  # (batch, context): KV splits to try
        (1, 512): (2, 4, 8),
        (1, 4096): (8, 16, 32, 64),
        (16, 512): (1, 2, 3, 4, 8),
        (16, 4096): (1, 2, 3, 4, 8),
        (64, 512): (1, 2),
    }
    for (batch, context), split_choices in shapes.items():
        problem = DecodeProblem(batch, context, device)
        best_sdpa = problem.best_peer_ms()
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4), (2, 3)):
            for splits in split_choices:
                if context // splits < block_n:
                    continue
                provider = TritonProvider()
                provider.decode_launch = {
                    "block_n": block_n, "num_warps": warps, "num_stages": stages
                }  # fmt: skip
                provider.decode_launch_one_wave = provider.decode_launch
                provider._num_kv_splits = lambda *_, s=splits: s
                try:
                    ms = measure(problem, provider, 128)["ms"]
                except Exception as error:  # e.g. out of shared memory
                    print(f"skip {provider.decode_launch} splits={splits}: {type(error).__name__}")
                    continue
                rows.append({
                    "batch": batch, "context": context, "block_n": block_n, "warps": warps,
                    "stages": stages, "splits": splits, "us": ms * 1e3,
                    "vs_best_sdpa": best_sdpa / ms,
                })  # fmt: skip
        best = sorted((r for r in rows if r["batch"] == batch and r["context"] == context),
                      key=lambda r: r["us"])[:8]  # fmt: skip
        _timing.print_table(list(best[0]), best)
        del problem
        torch.cuda.empty_cache()
    return rows


def profile_kernels(device: torch.device) -> None:
    """Device time of each kernel of batch 1 x 4096 (block 128), triton and its peers."""
    problem = DecodeProblem(1, 4096, device)
    run, _ = problem.paged_runner(TritonProvider(), 128)
    calls = [("triton", run)]
    for backend in _timing.SDPA_PEERS:
        for label, fn in (("", problem.sdpa), ("_packed", problem.sdpa_packed)):
            runner = _timing.peer_runner(backend, fn)
            if runner is not None:
                calls.append((backend + label, runner))
    for name, fn in calls:
        fn()
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(name)
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=6))


HOPPER_VARIANTS = {
    "portable": None,
    "n64_w4_s2": {"block_n": 64, "num_warps": 4, "num_stages": 2},
    "n64_w4_s3": {"block_n": 64, "num_warps": 4, "num_stages": 3},
    "n64_w8_s2": {"block_n": 64, "num_warps": 8, "num_stages": 2},
    "n128_w4_s2": {"block_n": 128, "num_warps": 4, "num_stages": 2},
    "n128_w8_s2": {"block_n": 128, "num_warps": 8, "num_stages": 2},
    "n128_w4_s3": {"block_n": 128, "num_warps": 4, "num_stages": 3},
}


def hopper_sweep(device: torch.device, names: list[str]) -> list[dict[str, Any]]:
    """The Gluon decode's launch settings (``HOPPER_VARIANTS``) and the portable kernel,
    block 128 and 16, on the small-batch shapes, in one run with the best SDPA peer;
    some shapes also with split counts other than the provider's."""
    rows = []
    shapes = (
        (1, 4096, None), (1, 4096, 8), (1, 4096, 32), (16, 512, None), (16, 512, 2),
        (4, 4096, None), (4, 4096, 2), (16, 4096, None),
    )  # fmt: skip
    for batch, context, splits in shapes:
        problem = DecodeProblem(batch, context, device)
        expected = problem.sdpa().float()
        best_sdpa = problem.best_peer_ms()
        for block_size, name in itertools.product(BLOCK_SIZES, names):
            launch = HOPPER_VARIANTS[name]
            if splits and launch is None:
                continue
            provider = TritonProvider()
            provider.hopper_decode = launch is not None
            provider.hopper_decode_launch = launch or provider.hopper_decode_launch
            if splits:
                provider._num_kv_splits = lambda *_, s=splits: s
            result = measure(problem, provider, block_size, expected)
            rows.append(sweep_row(problem, block_size, {"variant": name}, result, best_sdpa))
        del problem
        torch.cuda.empty_cache()
    _timing.print_table(list(rows[0]), rows)
    return rows


def peer_kernel_times(copies: list[DecodeProblem]) -> dict[str, float | str]:
    """Kernel-only times of the SDPA peers (``enable_gqa``) on ``copies`` of one problem."""
    times: dict[str, float | str] = {}
    for backend in KERNEL_TIME_PEERS:
        runners = [_timing.peer_runner(backend, p.sdpa) for p in copies]
        if any(r is None for r in runners):
            times[f"{backend}_kernel_us"] = times[f"{backend}_amortized_us"] = "n/a"
            continue
        times[f"{backend}_kernel_us"] = profiled_kernel_us(runners[0])
        times[f"{backend}_amortized_us"] = amortized_graph_us(runners)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true", help="sweep launch parameters first")
    parser.add_argument("--quick", action="store_true", help="batch <= 64, context <= 4096")
    parser.add_argument(
        "--profile", action="store_true", help="only list kernel times of batch 1 x 4096"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="only time pdl on/off, then launch x split choices, small batches",
    )
    parser.add_argument(
        "--hopper", action="store_true", help="only the Gluon decode's settings, small batches"
    )
    parser.add_argument(
        "--variants",
        default=",".join(HOPPER_VARIANTS),
        help="with --hopper: comma-separated names of HOPPER_VARIANTS (default: all)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        help="only this 8-bit cache kind against the 16-bit cache (see the module doc)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (--kv-cache-dtype)"
    )
    parser.add_argument(
        "--kv-variants",
        default="default,head_major_pages",
        help="with --kv-cache-dtype: comma-separated names of KV_DTYPE_VARIANTS",
    )
    args = parser.parse_args()
    device = _timing.require_cuda()
    if args.kv_cache_dtype:
        variants = args.kv_variants.split(",")
        rows = kv_cache_dtype_rows(device, args.kv_cache_dtype, args.rounds, variants)
        print(f"kv_cache_dtype={args.kv_cache_dtype} on {torch.cuda.get_device_name(device)}")
        _timing.print_table(list(rows[0]), rows)
        _timing.write_json(f"decode_{args.kv_cache_dtype}", {"rows": rows})
        return
    if args.hopper:
        rows = hopper_sweep(device, args.variants.split(","))
        _timing.write_json("decode_hopper", {"rows": rows})
        return
    if args.sweep:
        pdl_rows = pdl_sweep(device)
        _timing.write_json("decode_sweep", {"pdl_rows": pdl_rows, "rows": sweep(device)})
        return
    if args.profile:
        profile_kernels(device)
        return
    copy_bw = _timing.copy_bandwidth(device)
    floor_ms = _timing.graph_launch_floor_ms(device)
    provider = TritonProvider()
    portable = TritonProvider()
    portable.hopper_decode = False
    tuning = None
    if args.tune:
        tuning = tune(device)
        provider.decode_launch = tuning["launch"]
        provider.min_tokens_per_split = tuning["min_tokens_per_split"]
        provider.target_waves = tuning["target_waves"]
    rows = []
    for batch, context in itertools.product(BATCHES, CONTEXTS):
        if args.quick and (batch > 64 or context > 4096):
            continue
        problem = DecodeProblem(batch, context, device)
        expected = problem.sdpa().float()
        peer_us = {}
        for backend in _timing.SDPA_PEERS:
            ms = problem.peer_ms(backend)
            peer_us[backend] = ms * 1e3 if ms is not None else None
        best_peer_us = min(us for us in peer_us.values() if us is not None)
        copies = []
        if batch <= KERNEL_TIME_MAX_BATCH:
            copies = [problem] + [
                DecodeProblem(batch, context, device, seed) for seed in (1, 2, 3, 4)
            ]
            peer_kernel = peer_kernel_times(copies)
        for block_size in BLOCK_SIZES:
            result = measure(problem, provider, block_size, expected)
            us = result["ms"] * 1e3
            portable_result = measure(problem, portable, block_size, expected)
            gbps = problem.kv_bytes / (us * 1e-6) / 1e9
            row = {
                "batch": batch,
                "context": context,
                "block": block_size,
                "splits": result["kv_splits"],
                "triton_us": us,
                "portable_us": portable_result["ms"] * 1e3,
            }
            for backend, value in peer_us.items():
                row[f"{backend}_us"] = value if value is not None else "n/a"
            row["vs_default"] = peer_us["default"] / us if peer_us["default"] else "n/a"
            row["vs_best_sdpa"] = best_peer_us / us
            row["triton_GB/s"] = gbps
            row["bw_vs_copy"] = gbps * 1e9 / copy_bw
            row["max_err"] = max(
                result["max_abs_err_vs_sdpa"], portable_result["max_abs_err_vs_sdpa"]
            )
            if copies:
                runners = [p.paged_runner(provider, block_size)[0] for p in copies]
                row["triton_kernel_us"] = profiled_kernel_us(runners[0])
                row["triton_amortized_us"] = amortized_graph_us(runners)
                row.update(peer_kernel)
            rows.append(row)
        del problem, copies
        torch.cuda.empty_cache()
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
    print(f"graph of one tiny kernel: {floor_ms * 1e3:.1f} us (floor under every time below)")
    _timing.print_table(list(rows[0]), rows)
    _timing.write_json(
        "decode_attention",
        {
            "environment": _timing.environment(device),
            "copy_bandwidth_GBps": copy_bw / 1e9,
            "tiny_graph_us": floor_ms * 1e3,
            "provider_settings": {
                "decode_launch": provider.decode_launch,
                "min_tokens_per_split": provider.min_tokens_per_split,
                "target_waves": provider.target_waves,
            },
            "tuning": tuning,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
