"""Varlen attention over a paged KV cache, with optional split-KV (flash-decoding).

One kernel serves every batch state. A program owns one tile of query rows of one
request and one KV head: the rows are ``BLOCK_Q`` query tokens times the
``num_heads // num_kv_heads`` query heads that share the KV head (GQA packing), so
each K/V tile is loaded once for all of them. Query token ``t`` of a request with
``context_len = seq_len - query_len`` sits at key position ``context_len + t``.

- Varlen tiles (prefill, chunked prefill, prefix hits, mixed batches): the grid has
  ``tokens // BLOCK_Q + num_reqs`` tile slots, an upper bound on the tiles of any
  batch of that many tokens; each program finds its request by binary search over
  ``cu_seqlens_q`` (request ``r`` owns slots from ``cu_seqlens_q[r] // BLOCK_Q + r``)
  and exits when the slot is past the request's last tile.
- Decode tiles (decode, spec decode): one program per request and KV head, and
  ``num_splits`` programs along the key axis; each split covers an equal share of
  the request's keys (read from ``seq_lens`` on the device) and writes a partial
  output and its log-sum-exp, which a second kernel merges.

With ``lse`` given, each real query row also gets its log-sum-exp (natural log; the
kernels keep scores in log2 units and convert on the store); a row that sees no key
gets ``-inf`` and an output row of zeros.

8-bit pages (``npu_attention.kv_quant``) are loaded as they are and converted to the
query's dtype in registers (exact for int8 and e4m3 codes); the scales are applied
where they cost least: a per-tensor key scale with the score scale and the value
scale on the output; per-token-head key scales on the scores' columns and value
scales on the probabilities before ``P @ V``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from npu_attention.providers.triton_kernels.dequant import dequant_tl
from npu_attention.providers.triton_kernels.utils import next_power_of_2

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionLaunchConfig:
    """Tile shape and launch parameters of one attention launch.

    ``block_m`` query rows per program: tokens times the query heads of one KV head
    (GQA packing); ``block_n`` keys per loop step; ``num_splits > 1`` splits each
    decode request's keys over that many programs (decode tiles only).
    ``pdl``: programmatic dependent launch (Hopper and later; ignored where
    ``pdl_supported`` says no): each kernel of the launch may start while the kernel
    before it in the stream finishes, and waits for that kernel's memory before its
    first load; the merge of a split decode reads only its metadata before that wait.
    ``prefetch_tiles``: each decode program (CUDA, no sliding window) asks the L2 for the
    K/V rows of its first ``prefetch_tiles * block_n`` keys (rounded up to a power of
    two) as it starts, while its lengths are still on their way, instead of after them.
    ``fast_dequant``: 8-bit pages converted by integer and float arithmetic
    (``dequant.py``) instead of conversion instructions (CUDA, 16-bit queries).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    pdl: bool = False
    prefetch_tiles: int = 0
    fast_dequant: bool = False


@triton.jit
def _find_request(
    cu_seqlens_q_ptr, num_reqs, tile_slot, BLOCK_Q: tl.constexpr, REQS_PAD: tl.constexpr
):
    """Largest request ``r`` with ``cu_seqlens_q[r] // BLOCK_Q + r <= tile_slot``.

    ``REQS_PAD >= num_reqs``: one vector load of the offsets and a count (one trip to
    memory); ``REQS_PAD == 0``: a binary search (a trip per halving).
    """
    if REQS_PAD > 0:
        offs = tl.arange(0, REQS_PAD)
        in_batch = offs < num_reqs
        starts = tl.load(cu_seqlens_q_ptr + offs, mask=in_batch, other=0) // BLOCK_Q + offs
        found = tl.sum(((starts <= tile_slot) & in_batch).to(tl.int32), 0) - 1
    else:
        lo = tl.full([], 0, tl.int32)
        hi = tl.full([], 0, tl.int32) + num_reqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
            lo = tl.where(start <= tile_slot, mid, lo)
            hi = tl.where(start <= tile_slot, hi, mid - 1)
        found = lo
    return found


@triton.jit
def _softcap(scores, soft_cap):
    """``soft_cap * tanh(scores / soft_cap)``, with tanh written through sigmoid."""
    return soft_cap * (2.0 * tl.sigmoid(2.0 * scores / soft_cap) - 1.0)


@triton.jit
def _attend_keys(
    acc,
    l_i,
    m_i,
    q,
    k_ptr,
    v_ptr,
    block_table_row,
    kv_token_base,
    key_positions_start,
    key_positions_end,
    valid_end,
    query_pos,
    stride_kb,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vd,
    qk_scale,
    soft_cap,
    window,
    ks_ptr,
    vs_ptr,
    stride_ksb,
    stride_kst,
    stride_vsb,
    stride_vst,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    VALUE_SIZE: tl.constexpr,
    VALUE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_TILES: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr = 0,
    FAST_DEQUANT: tl.constexpr = False,
):
    """Online-softmax update over keys ``[key_positions_start, key_positions_end)``.

    With ``MASKED`` false every key of the range is known to be visible to every
    row (loads then carry no key mask, and no head mask when ``HEAD_SIZE`` /
    ``VALUE_SIZE`` is a power of two); otherwise keys ``>= valid_end`` and the causal /
    window masks apply. Values are ``VALUE_SIZE`` wide (MLA's prefill: 128 beside
    192-wide keys). ``m_i`` is kept in log2 units: ``scores * qk_scale`` (``qk_scale``
    includes log2(e)). ``KV_QUANT`` 2: ``ks_ptr``/``vs_ptr`` are the scale caches at
    this KV head (per token: block and slot strides); 1: the per-tensor scales are
    applied by the caller.
    """
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    offs_v = tl.arange(0, VALUE_PAD)
    v_mask = offs_v < VALUE_SIZE
    LOAD_MASKS: tl.constexpr = MASKED or HEAD_SIZE != HEAD_PAD
    V_LOAD_MASKS: tl.constexpr = MASKED or VALUE_SIZE != VALUE_PAD
    for start_n in tl.range(key_positions_start, key_positions_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:  # noqa: SIM108 (a constexpr branch, not a value choice)
            n_mask = offs_n < valid_end
        else:
            n_mask = offs_n >= 0
        if PAGE_TILES:  # each tile lies in one page
            block = tl.load(block_table_row + start_n // BLOCK_SIZE).to(tl.int64)
            in_page = start_n % BLOCK_SIZE + tl.arange(0, BLOCK_N)
            k_rows = block * stride_kb + in_page * stride_kt
            v_rows = block * stride_vb + in_page * stride_vt
            ks_rows = block * stride_ksb + in_page * stride_kst
            vs_rows = block * stride_vsb + in_page * stride_vst
        elif PAGED:
            if MASKED:
                blocks = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
            else:
                blocks = tl.load(block_table_row + offs_n // BLOCK_SIZE)
            blocks = blocks.to(tl.int64)
            k_rows = blocks * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
            v_rows = blocks * stride_vb + (offs_n % BLOCK_SIZE) * stride_vt
            ks_rows = blocks * stride_ksb + (offs_n % BLOCK_SIZE) * stride_kst
            vs_rows = blocks * stride_vsb + (offs_n % BLOCK_SIZE) * stride_vst
        else:
            tokens = (kv_token_base + offs_n).to(tl.int64)
            k_rows = tokens * stride_kt
            v_rows = tokens * stride_vt
            ks_rows = tokens * 0
            vs_rows = tokens * 0
        k_ptrs = k_ptr + k_rows[None, :] + offs_d[:, None] * stride_kd
        if LOAD_MASKS:
            k = tl.load(k_ptrs, mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if KV_QUANT > 0:
            k = dequant_tl(k, q.dtype) if FAST_DEQUANT else k.to(q.dtype)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION)
        if KV_QUANT == 2:
            k_scales = tl.load(ks_ptr + ks_rows, mask=n_mask, other=0.0)
            scores = scores * k_scales[None, :]
        if USE_SOFT_CAP:  # from here on, scores are in log2 units
            scores = _softcap(scores * qk_scale, soft_cap) * 1.4426950408889634
            score_scale = 1.0
        else:
            score_scale = qk_scale
        if MASKED:
            visible = n_mask[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= query_pos[:, None])
            if USE_WINDOW:
                visible = visible & (offs_n[None, :] > query_pos[:, None] - window)
                if not CAUSAL:  # a band on both sides
                    visible = visible & (offs_n[None, :] < query_pos[:, None] + window)
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1) * score_scale)
        if MASKED:  # noqa: SIM108 (constexpr branch; a row may not have seen a key yet)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.exp2(scores * score_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_ptr + v_rows[:, None] + offs_v[None, :] * stride_vd
        if V_LOAD_MASKS:
            v = tl.load(v_ptrs, mask=n_mask[:, None] & v_mask[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        p_v = p
        if KV_QUANT > 0:
            v = dequant_tl(v, q.dtype) if FAST_DEQUANT else v.to(q.dtype)
            if KV_QUANT == 2:
                p_v = p * tl.load(vs_ptr + vs_rows, mask=n_mask, other=0.0)[None, :]
        acc = tl.dot(p_v.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefetch_l2(ptrs):
    """Ask the L2 for the 128-byte lines at ``ptrs`` (a hint: nothing waits for it)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _prefetch_first_keys(
    k_base, v_base, block_table_row, table_width, num_cache_blocks,
    stride_kb, stride_kt, stride_vb, stride_vt,
    BLOCK_SIZE: tl.constexpr, PREFETCH_KEYS: tl.constexpr, HEAD_PAD: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
):  # fmt: skip
    """Prefetch the K/V rows of keys ``[0, PREFETCH_KEYS)`` of one request into the L2
    (``k_base``/``v_base``: the caches at its KV head) without knowing its length: pages
    past the table row are left out and stale page ids are clamped into the cache, so
    every address is in bounds."""
    offs_n = tl.arange(0, PREFETCH_KEYS)
    entry = offs_n // BLOCK_SIZE
    pages = tl.load(block_table_row + entry, mask=entry < table_width, other=0)
    pages = tl.minimum(tl.maximum(pages, 0), num_cache_blocks - 1).to(tl.int64)
    row_in_page = offs_n % BLOCK_SIZE
    lines = tl.arange(0, (HEAD_PAD + LINE_ELEMS - 1) // LINE_ELEMS) * LINE_ELEMS
    k_rows = pages * stride_kb + row_in_page * stride_kt
    v_rows = pages * stride_vb + row_in_page * stride_vt
    _prefetch_l2(k_base + k_rows[:, None] + lines[None, :])
    _prefetch_l2(v_base + v_rows[:, None] + lines[None, :])


@triton.jit
def _row_lse_log2(m_i, l_i):
    """Each row's log-sum-exp in log2 units (``m_i`` is; ``l_i`` sums exp2 of the scores
    less ``m_i``); ``-inf`` where the row saw no key (``l_i == 0``)."""
    return tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    lse_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_reqs,
    table_width,
    num_cache_blocks,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    stride_bt,
    qk_scale,
    soft_cap,
    window,
    k_scale_ptr,
    v_scale_ptr,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_vsb,
    stride_vst,
    stride_vsh,
    NUM_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    VALUE_SIZE: tl.constexpr,
    VALUE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE_TILES: tl.constexpr,
    SPLIT: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_TILES: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    REQS_PAD: tl.constexpr,
    PDL: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PREFETCH_KEYS: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
    KV_QUANT: tl.constexpr = 0,
    FAST_DEQUANT: tl.constexpr = False,
):
    if PDL:  # launched early: wait for the kernel before this one, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    kv_head = tl.program_id(1)  # rows: tokens x the query heads of this KV head
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    if DECODE_TILES:
        req = tl.program_id(0)
        q_tile = 0
    else:
        # Last tiles of a request see the most keys: start them first.
        tile_slot = tl.num_programs(0) - 1 - tl.program_id(0)
        req = _find_request(cu_seqlens_q_ptr, num_reqs, tile_slot, BLOCK_Q, REQS_PAD)
        q_tile = tile_slot - (tl.load(cu_seqlens_q_ptr + req) // BLOCK_Q + req)
    # Issue the three metadata loads together (each is a trip to device memory).
    q_start = tl.load(cu_seqlens_q_ptr + req)
    q_end = tl.load(cu_seqlens_q_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    ks_base = k_scale_ptr + kv_head.to(tl.int64) * stride_ksh
    vs_base = v_scale_ptr + kv_head.to(tl.int64) * stride_vsh
    if KV_QUANT == 1:  # the key scale joins the score scale
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if PREFETCH_KEYS > 0:  # noqa: SIM102 (constexpr branch); decode tiles, no window
        if split == 0:
            _prefetch_first_keys(
                k_base, v_base, block_table_row, table_width, num_cache_blocks,
                stride_kb, stride_kt, stride_vb, stride_vt,
                BLOCK_SIZE, PREFETCH_KEYS, HEAD_PAD, LINE_ELEMS,
            )  # fmt: skip
    q_len = q_end - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    token_in_req = q_tile * BLOCK_Q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_mask = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (token_in_req < q_len)
    token = (q_start + token_in_req).to(tl.int64)
    query_pos = context_len + token_in_req
    q = tl.load(
        q_ptr
        + token[:, None] * stride_qt
        + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & (offs_d < HEAD_SIZE)[None, :],
        other=0.0,
    )

    # Keys this tile can see: [kv_lo, kv_hi); all of [kv_lo, full_hi) is visible to every row.
    last_row_pos = context_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    first_row_pos = context_len + q_tile * BLOCK_Q
    kv_hi = seq_len
    full_hi = seq_len
    if CAUSAL:
        kv_hi = tl.minimum(seq_len, last_row_pos + 1)
        full_hi = tl.minimum(seq_len, first_row_pos + 1)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(0, first_row_pos - window + 1)
        if not CAUSAL:
            kv_hi = tl.minimum(seq_len, last_row_pos + window)
        full_hi = kv_lo  # every tile is masked
    kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * per_split
        kv_hi = tl.minimum(kv_hi, kv_lo + per_split)
        full_hi = tl.minimum(full_hi, kv_hi)
    full_hi = tl.maximum(kv_lo, kv_lo + ((full_hi - kv_lo) // BLOCK_N) * BLOCK_N)

    acc = tl.zeros([BLOCK_M, VALUE_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, k_base, v_base, block_table_row, q_start, kv_lo, full_hi, kv_hi,
        query_pos, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
        qk_scale, soft_cap, window, ks_base, vs_base, stride_ksb, stride_kst, stride_vsb,
        stride_vst, HEAD_SIZE, HEAD_PAD, VALUE_SIZE, VALUE_PAD, BLOCK_SIZE,
        BLOCK_N, PAGED, PAGE_TILES,
        False, CAUSAL, USE_WINDOW, USE_SOFT_CAP, DOT_PRECISION, KV_QUANT,
        FAST_DEQUANT,
    )  # fmt: skip
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, k_base, v_base, block_table_row, q_start, full_hi, kv_hi, kv_hi,
        query_pos, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
        qk_scale, soft_cap, window, ks_base, vs_base, stride_ksb, stride_kst, stride_vsb,
        stride_vst, HEAD_SIZE, HEAD_PAD, VALUE_SIZE, VALUE_PAD, BLOCK_SIZE,
        BLOCK_N, PAGED, PAGE_TILES,
        True, CAUSAL, USE_WINDOW, USE_SOFT_CAP, DOT_PRECISION, KV_QUANT,
        FAST_DEQUANT,
    )  # fmt: skip

    if KV_QUANT == 1:  # the value scale, on the output
        acc = acc * tl.load(v_scale_ptr)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no key seen: l_i = 0, acc = 0
    offs_v = tl.arange(0, VALUE_PAD)
    out_mask = row_mask[:, None] & (offs_v < VALUE_SIZE)[None, :]
    if SPLIT:
        lse = _row_lse_log2(m_i, l_i)
        row = (token * NUM_HEADS + head) * num_splits + split
        tl.store(partial_lse_ptr + row, lse, mask=row_mask)
        tl.store(partial_out_ptr + row[:, None] * VALUE_PAD + offs_v[None, :], out, mask=out_mask)
    else:
        dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(dst + offs_v[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        if WRITE_LSE:
            tl.store(
                lse_ptr + token * stride_lt + head * stride_lh,
                _row_lse_log2(m_i, l_i) * 0.6931471805599453,  # natural log: times ln(2)
                mask=row_mask,
            )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    lse_ptr,
    cu_seqlens_q_ptr,
    num_reqs,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    # Padding tokens' partial rows exist (unwritten): read them along with the token
    # count rather than after it, and only skip the store.
    num_real_tokens = tl.load(cu_seqlens_q_ptr + num_reqs)
    if PDL:  # the partials come from the kernel before this one (the metadata does not)
        tl.extra.cuda.gdc_wait()
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_mask = offs_s < num_splits
    row = (token.to(tl.int64) * NUM_HEADS + head) * num_splits + offs_s
    lse = tl.load(partial_lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    finite_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - finite_max)
    denominator = tl.sum(weights, 0)
    partial = tl.load(
        partial_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d < HEAD_SIZE)[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], 0) / tl.where(denominator > 0.0, denominator, 1.0)
    dst = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od
    tl.store(
        dst,
        out.to(out_ptr.dtype.element_ty),
        mask=(offs_d < HEAD_SIZE) & (token + 0 * offs_d < num_real_tokens),
    )
    if WRITE_LSE:  # the splits' combined LSE; -inf where no split saw a key
        safe = tl.where(denominator > 0.0, denominator, 1.0)
        merged = tl.where(denominator > 0.0, finite_max + tl.log2(safe), float("-inf"))
        dst_lse = lse_ptr + token.to(tl.int64) * stride_lt + head * stride_lh
        tl.store(dst_lse, merged * 0.6931471805599453, mask=token < num_real_tokens)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor | None,
    *,
    config: AttentionLaunchConfig,
    decode_tiles: bool,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    paged: bool = True,
    lse: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Attention of ``query`` ``[tokens, heads, head_size]`` into ``out`` ``[tokens,
    heads, value_size]``.

    Args:
        key_cache, value_cache: paged: ``[num_blocks, block_size, kv_heads, head_size]``
            and ``[..., value_size]`` (any strides; ``value_size`` is ``head_size`` but
            for MLA's prefill); not paged: ``[tokens, kv_heads, head_size]`` and
            ``[..., value_size]``, request ``r``'s keys at rows
            ``cu_seqlens_q[r]:cu_seqlens_q[r + 1]``.
        cu_seqlens_q: int32 ``[num_reqs + 1]`` on the device.
        seq_lens: int32 ``[num_reqs]``, context + new tokens of each request.
        block_tables: int32 ``[num_reqs, max_blocks]`` (paged only).
        config: tile shape; ``config.num_splits > 1`` needs ``decode_tiles``.
        decode_tiles: every request has at most ``config.block_m // (heads //
            kv_heads)`` query tokens; one program per request and KV head.
        lse: optional float32 ``[>= cu_seqlens_q[-1], heads]`` (any strides): each real
            row's natural-log log-sum-exp of its scaled (soft-capped) scores, ``-inf``
            for a row that sees no key. With splits, the merge writes the combined LSE.
        k_scale, v_scale: float32 scales of 8-bit pages (paged only): one element each,
            or ``[num_blocks, block_size, kv_heads]`` (any strides) per token and head;
            ``None`` for pages in the query's dtype.

    Rows of ``out`` (and ``lse``) past ``cu_seqlens_q[-1]`` are left untouched.
    """
    if not scale > 0.0:  # the kernel takes row maxima of unscaled scores
        raise ValueError(f"scale must be positive, got {scale}")
    num_tokens, num_heads, head_size = query.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return
    num_kv_heads = key_cache.shape[-2]
    queries_per_kv = num_heads // num_kv_heads
    head_pad = max(16, next_power_of_2(head_size))
    value_size = value_cache.shape[-1]
    value_pad = max(16, next_power_of_2(value_size))
    block_q = config.block_m // queries_per_kv
    num_splits = config.num_splits if decode_tiles else 1
    if paged:
        block_size = key_cache.shape[1]
        k_strides, v_strides = key_cache.stride(), value_cache.stride()
        stride_bt = block_tables.stride(0)
    else:
        block_size = 1
        k_strides = (0, *key_cache.stride())
        v_strides = (0, *value_cache.stride())
        block_tables, stride_bt = seq_lens, 0
    if decode_tiles:
        grid = (num_reqs, num_kv_heads, num_splits)
    else:
        grid = (num_tokens // block_q + num_reqs, num_kv_heads, 1)
    page_tiles = paged and block_size % config.block_n == 0
    split = num_splits > 1
    partial_out, partial_lse = split_buffers(out, num_splits, value_pad) if split else (out, out)
    use_pdl = config.pdl and pdl_supported(query.device)
    # PTX, so CUDA only; with a sliding window the first keys are not at position 0.
    prefetch = config.prefetch_tiles > 0 and query.device.type == "cuda"
    prefetch = prefetch and decode_tiles and paged and sliding_window is None
    prefetch_keys = next_power_of_2(config.prefetch_tiles * config.block_n) if prefetch else 0
    write_lse = lse is not None
    lse_arg, lse_strides = (lse, tuple(lse.stride())) if write_lse else (out, (0, 0))
    use_soft_cap = logits_soft_cap is not None
    qk_scale = scale if use_soft_cap else scale * _LOG2E  # soft cap: log2(e) after the cap
    kv_quant, scales, scale_strides = _scale_args(k_scale, v_scale, query)
    _paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        partial_out,
        partial_lse,
        lse_arg,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        num_reqs,
        block_tables.shape[1] if paged else 0,
        key_cache.shape[0] if paged else 0,
        *query.stride(),
        *k_strides,
        *v_strides,
        *out.stride(),
        *lse_strides,
        stride_bt,
        qk_scale,
        float(logits_soft_cap or 1.0),
        int(sliding_window or 0),
        *scales,
        *scale_strides,
        NUM_HEADS=num_heads,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        VALUE_SIZE=value_size,
        VALUE_PAD=value_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=config.block_n,
        DECODE_TILES=decode_tiles,
        SPLIT=split,
        PAGED=paged,
        PAGE_TILES=page_tiles,
        CAUSAL=causal,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=use_soft_cap,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        REQS_PAD=0 if decode_tiles else _request_lookup_width(num_reqs),
        PDL=use_pdl,
        WRITE_LSE=write_lse and not split,
        PREFETCH_KEYS=prefetch_keys,
        LINE_ELEMS=128 // key_cache.element_size(),
        KV_QUANT=kv_quant,
        FAST_DEQUANT=bool(kv_quant)
        and config.fast_dequant
        and query.device.type == "cuda"
        and query.dtype in (torch.float16, torch.bfloat16),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **_pdl_launch(use_pdl),
    )
    if split:
        merge_splits(
            out, partial_out, partial_lse, lse, cu_seqlens_q, num_reqs, num_splits, pdl=use_pdl
        )


def _scale_args(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, placeholder: torch.Tensor
) -> tuple[int, tuple[torch.Tensor, torch.Tensor], tuple[int, ...]]:
    """``KV_QUANT`` (0 none, 1 per tensor, 2 per token and head), the two scale pointers
    and their six strides (block, slot, head of each)."""
    if k_scale is None:
        return 0, (placeholder, placeholder), (0,) * 6
    if k_scale.dim() == 3:
        return 2, (k_scale, v_scale), (*k_scale.stride(), *v_scale.stride())
    return 1, (k_scale, v_scale), (0,) * 6


def split_buffers(
    out: torch.Tensor, num_splits: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial results of a decode split ``num_splits`` ways, for ``out`` ``[tokens,
    heads, head_size]``: float32 outputs ``[tokens * heads * num_splits, width]`` and
    log2-domain LSEs ``[tokens * heads * num_splits]`` (row ``(token * heads + head) *
    num_splits + split``), as :func:`merge_splits` reads them."""
    rows = out.shape[0] * out.shape[1] * num_splits
    partial_out = torch.empty((rows, width), dtype=torch.float32, device=out.device)
    partial_lse = torch.empty(rows, dtype=torch.float32, device=out.device)
    return partial_out, partial_lse


def merge_splits(
    out: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    lse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    num_reqs: int,
    num_splits: int,
    *,
    pdl: bool = False,
) -> None:
    """Merge the partial results of a split decode into ``out`` ``[tokens, heads,
    head_size]`` (and ``lse``, natural log, when given).

    ``partial_out`` float32 ``[tokens * heads * num_splits, head_pad]`` and
    ``partial_lse`` float32 ``[tokens * heads * num_splits]`` (log2 domain): row
    ``(token * heads + head) * num_splits + split``. ``pdl``: launched with
    programmatic dependent launch (the caller checks ``pdl_supported``).
    """
    num_tokens, num_heads, head_size = out.shape
    write_lse = lse is not None
    lse_arg, lse_strides = (lse, tuple(lse.stride())) if write_lse else (out, (0, 0))
    _merge_splits_kernel[(num_tokens, num_heads)](
        out,
        partial_out,
        partial_lse,
        lse_arg,
        cu_seqlens_q,
        num_reqs,
        num_splits,
        *out.stride(),
        *lse_strides,
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=partial_out.shape[1],
        SPLITS_PAD=next_power_of_2(num_splits),
        PDL=pdl,
        WRITE_LSE=write_lse,
        num_warps=4,
        **_pdl_launch(pdl),
    )


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch: a CUDA GPU
    of compute capability 9 or later (not the interpreter, not other backends)."""
    return device.type == "cuda" and _compute_capability(device.index or 0)[0] >= 9


def _pdl_launch(enabled: bool) -> dict[str, bool]:
    """The launch option of programmatic dependent launch, only where it is used (other
    backends and the interpreter may not know it)."""
    return {"launch_pdl": True} if enabled else {}


def _request_lookup_width(num_reqs: int) -> int:
    """``REQS_PAD`` of the varlen request lookup: a vector of 64 or 512 offsets, or 0
    (binary search) for larger batches. Two widths keep the compiled variants few."""
    for width in (64, 512):
        if num_reqs <= width:
            return width
    return 0


@functools.lru_cache(maxsize=16)
def _compute_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)
