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
are timed, each as ``npu_attention.run`` runs a layer: the new tokens' K/V written
into the pages (quantized for ``KIND``), then attention (``bf16_ms``, ``kind_ms``,
``ratio`` = kind / bf16; a prefill without cached context attends over its own rows
either way, a chunk after a prefix reads the pages).

With ``--prefill-variants ...,dequant_workspace`` (a prototype, not in the provider):
the chunk's 8-bit pages (prefix and the chunk's own rows, already written) are first
dequantized by one kernel into a compact 16-bit page pool (request ``r``'s page ``j``
at ``base[r] + j``), then the provider's 16-bit attention runs over the pool. It is
timed as one CUDA-graph replay (``dequant_workspace_graph``; ``dequant_only_graph``:
the dequantization alone, its ``max_err`` its largest difference from
``kv_quant.dequantize``; ``pool_attend_graph``: the attention alone over the filled
pool; ``dequant_flush_attend_graph``: the two with the L2 cache flushed between them,
``flush_graph`` that flush alone), beside graph replays of the 16-bit and the 8-bit
chunk (``vs_bf16`` of a ``_graph`` row is against ``bf16_graph``). ``--prefix N``
sets the chunk's cached prefix (default 4096).

    python benchmarks/bench_prefill_attention.py [--tune] [--rounds 3]
    python benchmarks/bench_prefill_attention.py --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
from typing import Any

import _timing  # first: puts the packages' src on sys.path
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from _paged_batch import attention_flops, causal_pairs, hand_plan, page_kv, permuted_block_tables
from _quantized_pages import quantized_pages
from torch.nn.attention.bias import causal_lower_right

from npu_attention import kv_quant
from npu_attention.kv_quant import KVScales
from npu_attention.providers.triton import TritonProvider
from npu_attention.spec import AttentionSpec

HEADS, KV_HEADS, HEAD_SIZE, DTYPE = 32, 8, 128, torch.bfloat16
PROBLEMS = {"prefill": (8, 2048, 0), "chunk_after_prefix": (1, 512, 4096)}


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
        attend_only: bool = False,
        write_only: bool = False,
    ):
        """A layer as ``npu_attention.run`` runs it: the new rows written into the pages
        (8-bit pages of ``kind`` unless ``auto``), then attention (``attend_only`` /
        ``write_only``: one of the two; the pages already hold the new rows)."""
        spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, block_size=block_size, dtype=DTYPE,
                             kv_cache_dtype=kind)  # fmt: skip
        pages = -(-self.seq_len // block_size)
        block_tables = permuted_block_tables(self.batch, pages, self.generator, self.key.device)
        padded = pages * block_size - self.seq_len
        key, value = (F.pad(t, (0, 0, 0, padded)) for t in (self.key, self.value))
        extra = {}
        if kind == "auto":
            key_cache = page_kv(key, block_size, block_tables)
            value_cache = page_kv(value, block_size, block_tables)
        else:
            key_cache, value_cache, scales = quantized_pages(
                key, value, block_size, block_tables, kind
            )
            extra["scales"] = scales
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
            if not attend_only:
                provider.write_kv(rows[0], rows[1], key_cache, value_cache, plan, **extra)
            if not write_only:
                provider.attend(query, key_cache, value_cache, plan, out, rows[0], rows[1], **extra)
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

    def workspace_runners(self, provider: TritonProvider, block_size: int, kind: str):
        """``(runners, dequant_err)``. ``runners``: the chunk over ``kind``'s pages (new
        rows already written) as the 8-bit pages dequantized into a 16-bit pool, then the
        16-bit attention over the pool (``dequant_workspace_graph``); the dequantization
        alone; the attention alone over the filled pool; the two with the L2 cache
        flushed between them (the pool read from memory, as when it outgrows L2), and
        that flush alone. ``dequant_err``: the pool's largest difference from
        ``kv_quant.dequantize`` (cast to the model dtype)."""
        pages = -(-self.seq_len // block_size)
        block_tables = permuted_block_tables(self.batch, pages, self.generator, self.key.device)
        padded = pages * block_size - self.seq_len
        key, value = (F.pad(t, (0, 0, 0, padded)) for t in (self.key, self.value))
        key_cache, value_cache, scales = quantized_pages(key, value, block_size, block_tables, kind)
        seq_lens = [self.seq_len] * self.batch
        workspace = DequantWorkspace(block_tables, seq_lens, block_size, key.device)
        spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, block_size=block_size, dtype=DTYPE)
        plan = hand_plan(
            spec, provider, [self.query_len] * self.batch, seq_lens, workspace.block_tables,
            num_decodes=0,
        )  # fmt: skip
        query, rows = self.token_rows()
        out = torch.empty_like(query)

        flush = torch.empty(256 << 20, dtype=torch.int8, device=key.device)  # > L2

        def dequant() -> tuple[torch.Tensor, torch.Tensor]:
            return workspace.fill(key_cache, value_cache, scales)

        def pool_attend() -> torch.Tensor:
            provider.attend(query, workspace.key, workspace.value, plan, out, rows[0], rows[1])
            return out

        def attend() -> torch.Tensor:
            dequant()
            return pool_attend()

        def flush_between() -> torch.Tensor:
            dequant()
            flush.zero_()
            return pool_attend()

        runners = {
            "dequant_workspace_graph": attend,
            "dequant_only_graph": dequant,
            "pool_attend_graph": pool_attend,
            "dequant_flush_attend_graph": flush_between,
            "flush_graph": flush.zero_,
        }
        pool_k, pool_v = dequant()
        errors = []
        for cache, pool, scale in ((key_cache, pool_k, scales.k), (value_cache, pool_v, scales.v)):
            for r in range(self.batch):
                blocks = block_tables[r].long()
                if scale.dim() == 3:
                    expected = kv_quant.dequantize(cache[blocks], scale[blocks].unsqueeze(-1))
                else:
                    expected = kv_quant.dequantize(cache[blocks], scale)
                got = pool[workspace.block_tables[r].long()].float()
                errors.append((got - expected.to(DTYPE).float()).abs().max().item())
        return runners, max(errors)

    def as_sdpa_layout(self, out: torch.Tensor) -> torch.Tensor:
        return out.view(self.batch, self.query_len, HEADS, HEAD_SIZE).transpose(1, 2)


@triton.jit
def _dequant_pages_kernel(
    k_codes, v_codes, k_scales, v_scales, k_pool, v_pool, block_tables, seq_lens, base,
    stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    ROWS: tl.constexpr, PER_TOKEN_HEAD: tl.constexpr,
):  # fmt: skip
    """``ROWS`` (slot, head) rows of request ``program_id(0)``'s page ``program_id(1)``:
    ``code * scale`` in float32, stored in the pool's dtype at page ``base[r] + j``."""
    req = tl.program_id(0)
    page = tl.program_id(1)
    if page * BLOCK_SIZE >= tl.load(seq_lens + req):
        return
    block = tl.load(block_tables + req * stride_bt + page).to(tl.int64)
    dst = (tl.load(base + req) + page).to(tl.int64)
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    slot, head = rows // KV_HEADS, rows % KV_HEADS
    cols = tl.arange(0, HEAD_SIZE)
    k = tl.load(k_codes + block * stride_kb + (slot * stride_kt + head * stride_kh)[:, None]
                + cols[None, :]).to(tl.float32)  # fmt: skip
    v = tl.load(v_codes + block * stride_vb + (slot * stride_vt + head * stride_vh)[:, None]
                + cols[None, :]).to(tl.float32)  # fmt: skip
    if PER_TOKEN_HEAD:
        k_rows = k_scales + block * stride_ksb + slot * stride_kst + head * stride_ksh
        v_rows = v_scales + block * stride_vsb + slot * stride_vst + head * stride_vsh
        k = k * tl.load(k_rows)[:, None]
        v = v * tl.load(v_rows)[:, None]
    else:
        k = k * tl.load(k_scales)
        v = v * tl.load(v_scales)
    out = dst * (BLOCK_SIZE * KV_HEADS * HEAD_SIZE) + rows[:, None] * HEAD_SIZE + cols[None, :]
    tl.store(k_pool + out, k.to(k_pool.dtype.element_ty))
    tl.store(v_pool + out, v.to(v_pool.dtype.element_ty))


class DequantWorkspace:
    """A compact 16-bit page pool for the pages a step's requests reference.

    ``block_tables`` int32 ``[batch, max_pages]`` and ``seq_lens`` (host ints) fix the
    pool: ``sum(cdiv(seq_len, block_size))`` pages of ``[block_size, kv_heads,
    head_size]`` (K and V, ``DTYPE``); ``self.block_tables`` maps request ``r``'s page
    ``j`` to pool page ``base[r] + j``.
    """

    ROWS = 64  # (slot, head) rows per program

    def __init__(
        self, block_tables: torch.Tensor, seq_lens: list[int], block_size: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        if (block_size * KV_HEADS) % self.ROWS:
            raise ValueError(f"block_size * kv_heads must divide by {self.ROWS}, got {block_size}")
        counts = [-(-n // block_size) for n in seq_lens]
        starts = [sum(counts[:r]) for r in range(len(counts))]
        self.block_size, self.max_pages = block_size, max(counts)
        self.source_tables = block_tables
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.base = torch.tensor(starts, dtype=torch.int32, device=device)
        self.block_tables = (
            self.base[:, None] + torch.arange(block_tables.shape[1], device=device)[None, :]
        ).to(torch.int32)
        shape = (sum(counts), block_size, KV_HEADS, HEAD_SIZE)
        self.key = torch.empty(shape, dtype=DTYPE, device=device)
        self.value = torch.empty(shape, dtype=DTYPE, device=device)

    def fill(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, scales: KVScales
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize the referenced pages of the 8-bit caches into the pool (one launch)."""
        per_token_head = scales.k.dim() == 3
        ks = scales.k.stride() if per_token_head else (0, 0, 0)
        vs = scales.v.stride() if per_token_head else (0, 0, 0)
        grid = (self.seq_lens.shape[0], self.max_pages, self.block_size * KV_HEADS // self.ROWS)
        _dequant_pages_kernel[grid](
            key_cache, value_cache, scales.k, scales.v, self.key, self.value,
            self.source_tables, self.seq_lens, self.base, self.source_tables.stride(0),
            *key_cache.stride()[:3], *value_cache.stride()[:3], *ks, *vs,
            BLOCK_SIZE=self.block_size, KV_HEADS=KV_HEADS, HEAD_SIZE=HEAD_SIZE,
            ROWS=self.ROWS, PER_TOKEN_HEAD=per_token_head, num_warps=4,
        )  # fmt: skip
        return self.key, self.value


def graphed(fn):
    """``fn`` captured as one CUDA graph; the returned callable replays it and returns
    what ``fn`` returned at capture (its output buffers)."""
    for _ in range(2):  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()

    def replay():
        graph.replay()
        return result

    return replay


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
    """The 16-bit and the ``kind`` cache on every problem and block size, interleaved."""
    provider = TritonProvider()
    rows = []
    for name, shape in PROBLEMS.items():
        problem = PrefillProblem(*shape, device)
        expected = problem.sdpa_runner()().float()
        for block_size in (128, 16):
            calls = {"bf16": problem.layer_runner(provider, block_size),
                     kind: problem.layer_runner(provider, block_size, kind)}  # fmt: skip
            errors = {
                label: (problem.as_sdpa_layout(run()).float() - expected).abs().max().item()
                for label, run in calls.items()
            }
            timed = _timing.interleaved_median_ms(calls, rounds)
            ms16, ms8 = timed["bf16"][0], timed[kind][0]
            rows.append({
                "problem": name, "block": block_size, "bf16_ms": ms16, "kind_ms": ms8,
                "ratio": ms8 / ms16, "bf16_TFLOP/s": problem.flops / (ms16 * 1e-3) / 1e12,
                "kind_TFLOP/s": problem.flops / (ms8 * 1e-3) / 1e12,
                "spread_%": max(timed["bf16"][1], timed[kind][1]),
                "bf16_err": errors["bf16"], "kind_err": errors[kind],
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
) -> list[dict[str, Any]]:
    """The chunk after a ``prefix``-token prefix: attention alone (no write) over the
    16-bit pages and over ``kind``'s pages with each of ``PREFILL_VARIANTS_8BIT``
    (``names``: those only), interleaved; and the write alone of each cache."""
    rows = []
    batch, query_len, _ = PROBLEMS["chunk_after_prefix"]
    problem = PrefillProblem(batch, query_len, prefix, device)
    expected = problem.sdpa_runner()().float()
    for block_size in (128, 16):
        calls = {"bf16": problem.layer_runner(TritonProvider(), block_size, attend_only=True),
                 "bf16_write": problem.layer_runner(TritonProvider(), block_size,
                                                    write_only=True),
                 f"{kind}_write": problem.layer_runner(TritonProvider(), block_size, kind,
                                                       write_only=True),
                 "default": problem.layer_runner(TritonProvider(), block_size, kind,
                                                 attend_only=True)}  # fmt: skip
        for name, launch in PREFILL_VARIANTS_8BIT.items():
            if names is not None and name not in names:
                continue
            provider = TritonProvider()
            provider.prefill_launch_8bit = launch
            calls[name] = problem.layer_runner(provider, block_size, kind, attend_only=True)
        checked = {}
        if names is None or "dequant_workspace" in names:
            calls["bf16_graph"] = graphed(calls["bf16"])
            calls["default_graph"] = graphed(calls["default"])
            runners, checked["dequant_only_graph"] = problem.workspace_runners(
                TritonProvider(), block_size, kind
            )
            checked["flush_graph"] = None
            calls.update({label: graphed(run) for label, run in runners.items()})
        errors = {}
        for label, run in list(calls.items()):
            try:
                result = run()
            except Exception as error:  # e.g. out of shared memory
                print(f"skip {label}: {type(error).__name__}: {error}"[:300])
                del calls[label]
                continue
            if label in checked:
                if checked[label] is not None:
                    errors[label] = checked[label]
            elif not label.endswith("_write"):
                errors[label] = (problem.as_sdpa_layout(result).float() - expected).abs().max()
        timed = _timing.interleaved_median_ms(calls, rounds)
        for label, (ms, spread) in timed.items():
            bf16 = timed["bf16_graph" if label.endswith("_graph") else "bf16"][0]
            rows.append({
                "block": block_size, "call": label, "ms": ms,
                "vs_bf16": ms / bf16, "spread_%": spread,
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
    args = parser.parse_args()
    device = _timing.require_cuda()
    if args.kv_cache_dtype and args.prefill_variants:
        names = None if args.prefill_variants == "all" else args.prefill_variants.split(",")
        kind = args.kv_cache_dtype
        rows = prefill_variant_rows(device, kind, args.rounds, names, args.prefix)
        floor = _timing.graph_launch_floor_ms(device)
        print(f"kv_cache_dtype={kind}, prefix {args.prefix} on "
              f"{torch.cuda.get_device_name(device)}; graph launch floor {floor:.4f} ms")  # fmt: skip
        _timing.print_table(list(rows[0]), rows)
        name = f"prefill_variants_{kind}"
        if args.prefix != PROBLEMS["chunk_after_prefix"][2]:
            name += f"_prefix{args.prefix}"
        _timing.write_json(name, {"prefix": args.prefix, "graph_floor_ms": floor, "rows": rows})
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
