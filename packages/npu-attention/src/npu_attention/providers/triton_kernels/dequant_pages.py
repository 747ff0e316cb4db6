"""A step's 8-bit pages dequantized once into a compact 16-bit page pool.

A prefill that reads cached keys from 8-bit pages (a prefix-cache hit, a chunk after
earlier chunks) converts every key and value tile once for every tile of query rows
in the portable kernel: a 512-token chunk of 32 query heads on 8 KV heads converts
each page 33 times (64-row tiles). Converting each referenced page once, ``code *
scale`` rounded to the query's dtype as ``npu_attention.kv_quant`` defines it, and
running the 16-bit kernel over the pool costs one pass over the pages instead.

The pool holds ``sum(cdiv(seq_len, block_size))`` pages ``[block_size, kv_heads,
head_size]`` for K and V, request ``r``'s page ``j`` at ``base[r] + j``. Slots past a
request's length are written as zeros, so that a stale code (a NaN of e4m3) never
meets a masked probability.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# (slot, KV head) rows a program converts, and its warps. H100, a 512-token chunk after
# 4096 (write + attention, int8 per token and head, block 128): 1.044x the 16-bit layer
# at 64 rows and 8 warps, 1.047-1.089x at 32-256 rows and 2-8 warps (benchmarks/README.md).
_MAX_ROWS = 64
_NUM_WARPS = 8


class PagePool:
    """One step's pool: laid out by ``prepare`` from the host lengths, its buffers
    allocated by the first layer that fills it (none where a graph replays the step) and
    refilled by every later one.

    ``counts``: each request's pages (host ints), ``pages`` their sum. Buffers: ``key``
    / ``value`` ``[pages, block_size, kv_heads, head_size]`` of the model dtype;
    ``tables`` int32 ``[num_reqs, table_width]``, request ``r``'s page ``j`` at ``base[r]
    + j`` (``base`` int32 ``[num_reqs]``, worked out on the device from the step's
    ``seq_lens``, with no copy from the host).
    """

    def __init__(
        self,
        seq_lens_host: list[int],
        table_width: int,
        page_shape: tuple[int, int, int],
        dtype: torch.dtype,
    ) -> None:
        """A pool for requests of ``seq_lens_host`` tokens, ``table_width`` entries in
        their block tables, pages of ``page_shape`` ``(block_size, kv_heads,
        head_size)`` in ``dtype``."""
        self.counts = [-(-n // page_shape[0]) for n in seq_lens_host]
        self.num_reqs, self.pages = len(self.counts), sum(self.counts)
        self.pages_of = max(self.counts, default=0)
        self.table_width, self.page_shape, self.dtype = table_width, page_shape, dtype
        block_size, kv_heads, _ = page_shape
        self._rows = math.gcd(_MAX_ROWS, block_size * kv_heads)
        self._grid = (self.num_reqs, self.pages_of, block_size * kv_heads // self._rows)
        self.key = self.value = self.tables = self.base = None

    @property
    def nbytes(self) -> int:
        """Bytes the K and V buffers take once allocated."""
        return 2 * self.pages * math.prod(self.page_shape) * self.dtype.itemsize

    def _allocate(self, seq_lens: torch.Tensor) -> None:
        block_size = self.page_shape[0]
        device = seq_lens.device
        counts = (seq_lens[: self.num_reqs] + block_size - 1) // block_size
        self.base = (torch.cumsum(counts, 0) - counts).to(torch.int32)
        width = torch.arange(self.table_width, device=device)
        self.tables = (self.base[:, None] + width).to(torch.int32)
        self.key = torch.empty((self.pages, *self.page_shape), dtype=self.dtype, device=device)
        self.value = torch.empty_like(self.key)

    def fill(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantize the pages each request references into the pool (one launch);
        returns ``(key, value, tables)``.

        Args:
            key_cache, value_cache: int8 / float8_e4m3fn ``[num_blocks, block_size,
                kv_heads, head_size]`` (any strides but the last, 1).
            k_scale, v_scale: float32, one element (per tensor) or ``[num_blocks,
                block_size, kv_heads]`` (per token and head, any strides).
            block_tables: int32 ``[>= num_reqs, table_width]``; seq_lens: int32
                ``[>= num_reqs]``, as the pool was laid out for.
        """
        if self.key is None:
            self._allocate(seq_lens)
        if not (self.num_reqs and self.pages_of):
            return self.key, self.value, self.tables
        block_size, kv_heads, head_size = self.page_shape
        per_token_head = k_scale.dim() == 3
        ks = k_scale.stride() if per_token_head else (0, 0, 0)
        vs = v_scale.stride() if per_token_head else (0, 0, 0)
        _dequant_pages_kernel[self._grid](
            key_cache, value_cache, k_scale, v_scale, self.key, self.value, block_tables,
            seq_lens, self.base, block_tables.stride(0), *key_cache.stride()[:3],
            *value_cache.stride()[:3], *ks, *vs,
            BLOCK_SIZE=block_size, KV_HEADS=kv_heads, HEAD_SIZE=head_size,
            HEAD_PAD=triton.next_power_of_2(head_size), ROWS=self._rows,
            PER_TOKEN_HEAD=per_token_head, num_warps=_NUM_WARPS,
        )  # fmt: skip
        return self.key, self.value, self.tables


@triton.jit
def _dequant_pages_kernel(
    k_codes, v_codes, k_scales, v_scales, k_pool, v_pool, block_tables, seq_lens, base,
    stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, ROWS: tl.constexpr, PER_TOKEN_HEAD: tl.constexpr,
):  # fmt: skip
    """``ROWS`` (slot, head) rows of request ``program_id(0)``'s page ``program_id(1)``:
    ``code * scale`` in float32, stored in the pool's dtype at page ``base[r] + j``;
    slots past the request's length as zeros."""
    req = tl.program_id(0)
    page = tl.program_id(1)
    filled = tl.load(seq_lens + req) - page * BLOCK_SIZE
    if filled <= 0:
        return
    block = tl.load(block_tables + req * stride_bt + page).to(tl.int64)
    dst = (tl.load(base + req) + page).to(tl.int64)
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    slot, head = rows // KV_HEADS, rows % KV_HEADS
    cols = tl.arange(0, HEAD_PAD)
    mask = (slot < filled)[:, None] & (cols < HEAD_SIZE)[None, :]
    k_at = block * stride_kb + (slot * stride_kt + head * stride_kh)[:, None] + cols[None, :]
    v_at = block * stride_vb + (slot * stride_vt + head * stride_vh)[:, None] + cols[None, :]
    k = tl.where(mask, tl.load(k_codes + k_at, mask=mask).to(tl.float32), 0.0)
    v = tl.where(mask, tl.load(v_codes + v_at, mask=mask).to(tl.float32), 0.0)
    if PER_TOKEN_HEAD:
        live = slot < filled
        k_row = block * stride_ksb + slot * stride_kst + head * stride_ksh
        v_row = block * stride_vsb + slot * stride_vst + head * stride_vsh
        k = k * tl.load(k_scales + k_row, mask=live, other=0.0)[:, None]
        v = v * tl.load(v_scales + v_row, mask=live, other=0.0)[:, None]
    else:
        k = k * tl.load(k_scales)
        v = v * tl.load(v_scales)
    out = dst * (BLOCK_SIZE * KV_HEADS * HEAD_SIZE) + rows[:, None] * HEAD_SIZE + cols[None, :]
    store = (cols < HEAD_SIZE)[None, :]
    tl.store(k_pool + out, k.to(k_pool.dtype.element_ty), mask=store)
    tl.store(v_pool + out, v.to(v_pool.dtype.element_ty), mask=store)
