"""Absorbed MLA decode: multi-query attention over a paged latent cache, split-KV.

A program owns one decode request, ``BLOCK_H`` query heads and one split of the
request's keys. Its rows are the request's query tokens (``Q_TOKENS``, speculative
tokens included) times those heads, so each latent tile is loaded once for all of
them: scores are ``q_latent . kv_c + q_rope . k_pe`` and the output accumulates
``P . kv_c`` (the value is the latent itself). Query token ``t`` of a request with
``context_len = seq_len - query_len`` sees keys ``< context_len + t + 1``.

With one split the program writes the normalized output; with several, each split
writes its partial output and log-sum-exp (base 2) and a second launch merges them.
With ``WRITE_LSE`` the row's natural-log log-sum-exp is written too (``-inf`` for a
request of KV length 0, whose output is zeros), by whichever launch writes the output.
An fp8 latent cache (one scale for both planes, vLLM's MLA ``fp8``) is loaded as e4m3
codes and converted in registers (``dequant.py`` on a GPU); the scale joins the score
scale and multiplies the output.

Per-step arguments (query offsets, sequence lengths, block tables) are read on the
device and the grid depends only on the plan's request count and the split count,
so the launches can be captured in a device graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from npu_attention.providers.triton_kernels.dequant import dequant_tl
from npu_attention.providers.triton_kernels.utils import next_power_of_2

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MLADecodeConfig:
    """``block_h`` heads per program, ``block_n`` keys per loop step, ``num_splits``
    programs along each request's keys, and the launch's warps and pipeline stages."""

    block_h: int = 16
    block_n: int = 32
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _mla_decode_kernel(
    q_latent_ptr,
    q_rope_ptr,
    kv_c_ptr,
    k_pe_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    k_scale_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_rt,
    stride_rh,
    stride_rd,
    stride_cb,
    stride_cs,
    stride_cd,
    stride_pb,
    stride_ps,
    stride_pd,
    stride_btr,
    stride_btc,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    NUM_HEADS: tl.constexpr,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    FP8: tl.constexpr = False,
    FAST_DEQUANT: tl.constexpr = False,
):
    request = tl.program_id(0)
    if FP8:  # scores and output scaled once: the codes' dot products times the scale
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    split = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + request)
    q_len = tl.load(cu_seqlens_q_ptr + request + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + request)

    rows = tl.arange(0, ROWS)
    token = rows // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + rows % BLOCK_H
    row_ok = (token < q_len) & (head < NUM_HEADS)
    visible_end = seq_len - q_len + token + 1  # causal: keys < this
    q_rows = (q_start + token).to(tl.int64)

    offs_l = tl.arange(0, LATENT_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    l_ok = offs_l < LATENT
    r_ok = offs_r < ROPE
    q = tl.load(
        q_latent_ptr
        + q_rows[:, None] * stride_qt
        + head[:, None] * stride_qh
        + offs_l[None, :] * stride_qd,
        mask=row_ok[:, None] & l_ok[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_rope_ptr
        + q_rows[:, None] * stride_rt
        + head[:, None] * stride_rh
        + offs_r[None, :] * stride_rd,
        mask=row_ok[:, None] & r_ok[None, :],
        other=0.0,
    )

    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    key_lo = split * per_split
    key_hi = tl.minimum(seq_len, key_lo + per_split)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, LATENT_PAD], tl.float32)
    table_row = block_tables_ptr + request.to(tl.int64) * stride_btr
    for start in range(key_lo, key_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < key_hi
        page = tl.load(table_row + (pos // PAGE) * stride_btc, mask=pos_ok, other=0).to(tl.int64)
        slot_c = page * stride_cb + (pos % PAGE) * stride_cs
        slot_p = page * stride_pb + (pos % PAGE) * stride_ps
        kv_c = tl.load(
            kv_c_ptr + slot_c[:, None] + offs_l[None, :] * stride_cd,
            mask=pos_ok[:, None] & l_ok[None, :],
            other=0.0,
        )
        k_pe = tl.load(
            k_pe_ptr + slot_p[:, None] + offs_r[None, :] * stride_pd,
            mask=pos_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        if FP8:
            if FAST_DEQUANT:
                kv_c = dequant_tl(kv_c, q.dtype)
                k_pe = dequant_tl(k_pe, q.dtype)
            else:
                kv_c = kv_c.to(q.dtype)
                k_pe = k_pe.to(q.dtype)
        scores = tl.dot(q, tl.trans(kv_c), input_precision=PRECISION)
        scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
        scores *= scale_log2
        seen = (pos[None, :] < visible_end[:, None]) & pos_ok[None, :]
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(scores - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv_c.dtype), kv_c, input_precision=PRECISION)
        m_i = m_new

    normalized = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8:
        normalized = normalized * tl.load(k_scale_ptr)
    lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    if SPLITS == 1:
        tl.store(
            out_ptr
            + q_rows[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_l[None, :] * stride_od,
            normalized.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & l_ok[None, :],
        )
        if WRITE_LSE:
            tl.store(
                lse_ptr + q_rows * stride_lt + head * stride_lh,
                lse2 * 0.6931471805599453,
                mask=row_ok,
            )
    else:
        partial = (q_rows * NUM_HEADS + head) * SPLITS + split
        tl.store(
            partial_out_ptr + partial[:, None] * LATENT_PAD + offs_l[None, :],
            normalized,
            mask=row_ok[:, None],
        )
        tl.store(partial_lse_ptr + partial, lse2, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    lse_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    NUM_HEADS: tl.constexpr,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_l = tl.arange(0, LATENT_PAD)
    s_ok = offs_s < SPLITS
    first = (token * NUM_HEADS + head) * SPLITS
    lse = tl.load(partial_lse_ptr + first + offs_s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(
        partial_out_ptr + (first + offs_s)[:, None] * LATENT_PAD + offs_l[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    merged = tl.sum(weights[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_l * stride_od,
        merged.to(out_ptr.dtype.element_ty),
        mask=offs_l < LATENT,
    )
    if WRITE_LSE:
        row_lse = tl.where(total == 0.0, float("-inf"), top + tl.log2(total))
        tl.store(lse_ptr + token * stride_lt + head * stride_lh, row_lse * 0.6931471805599453)


def merge_mla_splits(
    out: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    lse: torch.Tensor | None,
    num_decode_tokens: int,
    num_splits: int,
) -> None:
    """Merge a split decode's partial rows into ``out`` ``[tokens, N, L]`` (and ``lse``,
    natural log, when given), rows ``< num_decode_tokens``; a program per row.

    ``partial_out`` float32 ``[num_decode_tokens * N * num_splits, L_pad]`` (``L``
    rounded up to a power of two) and ``partial_lse`` float32 ``[num_decode_tokens * N *
    num_splits]`` (log2 domain): row ``(token * N + head) * num_splits + split``.
    """
    num_heads, latent = out.shape[1], out.shape[2]
    lse_arg = out if lse is None else lse  # unused without WRITE_LSE
    lse_strides = (0, 0) if lse is None else lse.stride()
    _merge_splits_kernel[(num_decode_tokens, num_heads)](
        partial_out,
        partial_lse,
        out,
        lse_arg,
        *out.stride(),
        *lse_strides,
        NUM_HEADS=num_heads,
        LATENT=latent,
        LATENT_PAD=partial_out.shape[1],
        SPLITS=num_splits,
        SPLITS_PAD=next_power_of_2(num_splits),
        WRITE_LSE=lse is not None,
        num_warps=4,
    )


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_c_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    num_decodes: int,
    num_decode_tokens: int,
    max_query_len: int,
    scale: float,
    config: MLADecodeConfig,
    lse: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
) -> None:
    """Absorbed attention of the first ``num_decodes`` requests (see the module doc).

    Args:
        q_latent: ``[tokens, N, L]``; q_rope: ``[tokens, N, R]`` (any strides).
        kv_c_cache: ``[blocks, block_size, L]``; k_pe_cache: ``[blocks, block_size, R]``.
        block_tables: int32 ``[reqs, max_blocks]``; cu_seqlens_q: int32 ``[reqs + 1]``;
            seq_lens: int32 ``[reqs]`` (device).
        out: ``[tokens, N, L]``, rows ``< num_decode_tokens`` written.
        max_query_len: bound on a decode request's query tokens (sets the rows per program).
        lse: optional float32 ``[tokens, N]``, rows ``< num_decode_tokens`` get the
            natural-log log-sum-exp.
        k_scale: float32, one element: the caches are float8_e4m3fn, read as
            ``code * k_scale``.
    """
    num_heads, latent = q_latent.shape[1], q_latent.shape[2]
    rope = q_rope.shape[2]
    latent_pad, rope_pad = next_power_of_2(max(latent, 16)), next_power_of_2(max(rope, 16))
    block_h = min(config.block_h, next_power_of_2(num_heads))
    rows = max(16, next_power_of_2(max_query_len) * block_h)
    splits = config.num_splits
    partial_out = partial_lse = out  # unused with one split
    if splits > 1:
        partial_out = torch.empty(
            num_decode_tokens * num_heads * splits,
            latent_pad,
            dtype=torch.float32,
            device=out.device,
        )
        partial_lse = torch.empty(
            num_decode_tokens * num_heads * splits, dtype=torch.float32, device=out.device
        )
    grid = (num_decodes, triton.cdiv(num_heads, block_h), splits)
    lse_arg = out if lse is None else lse  # unused without WRITE_LSE
    lse_strides = (0, 0) if lse is None else lse.stride()
    _mla_decode_kernel[grid](
        q_latent,
        q_rope,
        kv_c_cache,
        k_pe_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        lse_arg,
        partial_out,
        partial_lse,
        scale * _LOG2E,
        out if k_scale is None else k_scale,  # unused without FP8
        *q_latent.stride(),
        *q_rope.stride(),
        *kv_c_cache.stride(),
        *k_pe_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        *lse_strides,
        NUM_HEADS=num_heads,
        LATENT=latent,
        LATENT_PAD=latent_pad,
        ROPE=rope,
        ROPE_PAD=rope_pad,
        BLOCK_H=block_h,
        ROWS=rows,
        BLOCK_N=config.block_n,
        PAGE=kv_c_cache.shape[1],
        SPLITS=splits,
        PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        WRITE_LSE=lse is not None,
        FP8=k_scale is not None,
        FAST_DEQUANT=k_scale is not None
        and q_latent.is_cuda
        and q_latent.dtype in (torch.float16, torch.bfloat16),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        merge_mla_splits(out, partial_out, partial_lse, lse, num_decode_tokens, splits)
