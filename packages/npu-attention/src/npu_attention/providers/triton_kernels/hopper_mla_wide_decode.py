"""Absorbed MLA decode of many query rows a request for Hopper GPUs: warpgroup MMAs.

With 128 query heads (DeepSeek served with data-parallel attention) a decode does
about 240 flops per byte of latent cache: its time is the tensor cores', and the
``mma.sync`` consumer of ``hopper_mla_decode.py`` leaves them half idle. This kernel
gives each program 64 of a request's query rows (its tokens x heads, token-major: 64
heads of one token; with 3 tokens of 128 heads, six full programs) and computes both
products with asynchronous warpgroup MMAs (``wgmma``) from shared memory:

- one loader warp (``hopper_decode.load_ring``) fetches each 64-key tile of latent
  (512) and rope (64) rows with the tensor-memory accelerator into a ring of two
  stages, one ahead of the tile in use;
- the query rows stay in shared memory for the whole program; the latent tile is read
  there by both ``Q @ K^T`` and ``P @ V`` (V: its first 512 columns);
- two consumer warpgroups split the work by columns: each computes the scores of 32 of
  the tile's 64 keys over the whole 576-wide row (the row maxima and sums are reduced
  across both) and accumulates 256 of the 512 output columns (128 float32 registers a
  thread), ``P`` staying in registers as the A operand of the second product
  (gathered from both warpgroups' halves);
- each tile's scores are issued right behind the previous tile's ``P @ V``, whose
  stage goes back to the loader as soon as that product is done, so that the next
  tile's fetch has most of a tile's work to arrive in;
- a request's keys are split over programs to fill the multiprocessors, and the merge
  kernel of ``mla_decode.py`` combines the splits by their log-sum-exps.

It covers ``kv_lora_rank`` 512, rope 64, float16 / bfloat16, pages of a power of two
from 8 tokens, requests of more than 32 query rows (heads x tokens; spec decode
tokens causal among themselves), splits and the optional log-sum-exp. Keys past a request's end in its
last tile (unused page slots, which may hold anything, NaN included) are zeroed in
shared memory before ``P @ V`` reads them. :func:`shape_supported` says which shapes
it takes; the caller checks the device (compute capability 9.x), the Triton version
and the tensors (``hopper_mla_decode.hopper_mla_decode_supported``).
"""

import torch

from npu_attention.providers.triton_kernels.mla_decode import merge_mla_splits
from npu_attention.providers.triton_kernels.utils import nvmma_shared_layout

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from npu_attention.providers.triton_kernels.hopper_decode import split_key_range
    from npu_attention.providers.triton_kernels.hopper_mla_decode import (
        DecodeShape,
        clear_keys_past,
        load_partition,
    )

    HAVE_GLUON = True
except ImportError:  # older Triton, triton-ascend: the other kernels serve
    HAVE_GLUON = False

_LOG2E = 1.4426950408889634
LATENT = 512  # kv_lora_rank the kernel takes
ROPE = 64  # qk_rope_head_dim the kernel takes
BLOCK_M = 64  # query rows of a program: heads x query tokens
BLOCK_N = 64  # keys a tile
STAGES = 2  # tiles in flight: two beside the query rows fill the shared memory


def program_rows(num_heads: int, tokens_per_req: int) -> int:
    """Query rows of one program: ``BLOCK_M`` of a request's heads x tokens, or all of
    them where they are fewer."""
    return min(BLOCK_M, num_heads * tokens_per_req)


def programs_per_request(num_heads: int, tokens_per_req: int) -> int:
    """Programs that share a request's rows (heads x tokens), ``BLOCK_M`` each."""
    return -(-num_heads * tokens_per_req // BLOCK_M)


def shape_supported(
    kv_lora_rank: int,
    rope_dim: int,
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    tokens_per_req: int,
) -> bool:
    """Whether the kernel takes these widths, dtype, page size, heads and query tokens
    a request: latent 512 + rope 64, fp16/bf16, a power-of-two page of at least 8
    tokens, and more than half ``BLOCK_M`` rows of heads x tokens a request, so that
    the 64-row warpgroup MMAs carry no more padding than real rows."""
    if not 1 <= tokens_per_req <= BLOCK_M or num_heads < 1:
        return False
    rows = num_heads * tokens_per_req
    return (
        kv_lora_rank == LATENT
        and rope_dim == ROPE
        and dtype in (torch.float16, torch.bfloat16)
        and block_size >= 8
        and block_size & (block_size - 1) == 0
        and rows > BLOCK_M // 2
    )


def hopper_mla_wide_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    num_decodes: int,
    num_decode_tokens: int,
    tokens_per_req: int,
    scale: float,
    num_splits: int = 1,
    lse: torch.Tensor | None = None,
) -> None:
    """Absorbed attention of the first ``num_decodes`` requests into ``out``.

    Args:
        q_latent: ``[tokens, heads, 512]`` fp16/bf16; q_rope: ``[tokens, heads, 64]``;
            request ``r`` holds rows ``cu_seqlens_q[r]:cu_seqlens_q[r + 1]``, at most
            ``tokens_per_req`` of them, causal among themselves.
        kv_c: ``[num_blocks, block_size, 512]``; k_pe: ``[num_blocks, block_size, 64]``.
        out: ``[tokens, heads, 512]``; rows ``< num_decode_tokens`` are written.
        cu_seqlens_q: int32 ``[reqs + 1]``; seq_lens: int32 ``[reqs]`` (context + new
            tokens); block_tables: int32 ``[reqs, max_blocks]``; all on the device.
        num_splits: programs along each request's keys, merged by a second kernel.
        lse: optional float32 ``[>= num_decode_tokens, heads]``: each decode row's
            natural-log log-sum-exp, ``-inf`` for a row that sees no key.

    The caller checks :func:`shape_supported` and
    ``hopper_mla_decode.hopper_mla_decode_supported``.
    """
    num_heads = q_latent.shape[1]
    if num_decodes == 0 or num_decode_tokens == 0:
        return
    block_size = kv_c.shape[1]
    page_rows = min(block_size, BLOCK_N)
    dtype = gl.float16 if q_latent.dtype == torch.float16 else gl.bfloat16
    kv_desc = _page_descriptor(kv_c, page_rows, dtype)
    pe_desc = _page_descriptor(k_pe, page_rows, dtype)
    split = num_splits > 1
    partial_out = partial_lse = out  # unused without splits
    if split:
        rows = num_decode_tokens * num_heads * num_splits
        partial_out = torch.empty(rows, LATENT, dtype=torch.float32, device=out.device)
        partial_lse = torch.empty(rows, dtype=torch.float32, device=out.device)
    write_lse = lse is not None and not split
    lse_arg, lse_strides = (lse, tuple(lse.stride())) if write_lse else (out, (0, 0))
    grid = (programs_per_request(num_heads, tokens_per_req), num_decodes, num_splits)
    _wide_decode_kernel[grid](
        q_latent,
        q_rope,
        kv_desc,
        pe_desc,
        out,
        partial_out,
        partial_lse,
        lse_arg,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        block_tables.shape[1],
        block_tables.stride(0),
        *q_latent.stride()[:2],
        *q_rope.stride()[:2],
        *out.stride()[:2],
        *lse_strides,
        scale * _LOG2E,
        NUM_HEADS=num_heads,
        ROWS=num_heads * tokens_per_req,
        BLOCK_SIZE=block_size,
        SPLIT=split,
        WRITE_LSE=write_lse,
        TILE_M=BLOCK_M,
        TILE_N=BLOCK_N,
        RING=STAGES,
        q_layout=nvmma_shared_layout(BLOCK_M, LATENT, dtype),
        qr_layout=nvmma_shared_layout(BLOCK_M, ROPE, dtype),
        num_warps=8,
        maxnreg=168,
    )
    if split:
        merge_mla_splits(out, partial_out, partial_lse, lse, num_decode_tokens, num_splits)


def _page_descriptor(plane: torch.Tensor, page_rows: int, dtype) -> "TensorDescriptor":
    """A 2-D descriptor over a cache plane seen as ``[num_blocks * block_size, width]``;
    a box is ``page_rows`` rows of one page."""
    num_blocks, block_size, width = plane.shape
    layout = nvmma_shared_layout(page_rows, width, dtype)
    return TensorDescriptor(
        plane, [num_blocks * block_size, width], [plane.stride(1), 1], [page_rows, width], layout
    )


if HAVE_GLUON:

    @gluon.jit
    def _query_rows(r, q_len, shape: DecodeShape):
        """Row ``r`` of the program: ``program * BLOCK_M + r`` of the request's tokens x
        heads (token-major) as its token within the request and its head, and whether
        it is a real row (within the heads x tokens and the request's tokens)."""
        g = gl.program_id(0) * shape.block_m + r
        token_in_req = g // shape.num_heads
        return token_in_req, g % shape.num_heads, (g < shape.rows) & (token_in_req < q_len)

    @gluon.jit
    def _stage_queries(
        q_ptr, qr_ptr, q_smem, qr_smem, q_start, q_len,
        stride_qt, stride_qh, stride_rt, stride_rh, shape: DecodeShape,
    ):  # fmt: skip
        """The program's query rows into shared memory (:func:`_query_rows`), zeros
        past the request's tokens and rows; 64 columns at a time."""
        plain: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        CHUNK: gl.constexpr = qr_smem.type.shape[1]
        WIDTH: gl.constexpr = q_smem.type.shape[1]
        r = gl.arange(0, shape.block_m, layout=gl.SliceLayout(1, plain))
        d = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, plain))
        token_in_req, head, valid = _query_rows(r, q_len, shape)
        valid = valid[:, None]
        token = (q_start + token_in_req).to(gl.int64)
        q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        qr_rows = qr_ptr + token[:, None] * stride_rt + head[:, None] * stride_rh + d[None, :]
        qr_smem.store(gl.load(qr_rows, mask=valid, other=0.0))
        for c in gl.static_range(WIDTH // CHUNK):
            chunk = gl.load(q_rows + c * CHUNK, mask=valid, other=0.0)
            q_smem.slice(c * CHUNK, CHUNK, dim=1).store(chunk)
        fence_async_shared()  # the warpgroup MMAs read these rows next
        gl.thread_barrier()

    @gluon.jit
    def _scores(q_smem, qr_smem, kv_tile, pe_tile, zero_s):
        """Issue ``Q @ K^T`` of a tile (asynchronous): the latent, then the rope."""
        s = warpgroup_mma(q_smem, kv_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        return warpgroup_mma(qr_smem, pe_tile.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _softmax(s, m_i, l_i, first, row_end, MASKED: gl.constexpr, qk_scale):
        """One tile's online-softmax step (log2 domain): the probabilities, the factor
        that rescales the earlier output, and the new running max and sum. With
        ``MASKED``, keys at or past each row's end score ``-inf``."""
        BLOCK_N_: gl.constexpr = s.type.shape[1]
        if MASKED:
            keys = first + gl.arange(0, BLOCK_N_, layout=gl.SliceLayout(0, s.type.layout))
            s = gl.where(keys[None, :] < row_end[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _attend(
        q_smem, qr_smem, kv_smem, pe_smem, ready, empty, lo, hi, row_end, num_full,
        qk_scale, o_layout: gl.constexpr, s_layout: gl.constexpr,
    ):  # fmt: skip
        """The program's rows against its key tiles ``[lo, hi)``: the unnormalized
        output ``[BLOCK_M, 512]`` and each row's running max and sum (log2 domain)."""
        RING: gl.constexpr = kv_smem.type.shape[0]
        TILE: gl.constexpr = kv_smem.type.shape[1]
        ROWS_M: gl.constexpr = q_smem.type.shape[0]
        WIDTH: gl.constexpr = kv_smem.type.shape[2]
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        m_i = gl.full([ROWS_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        o = gl.zeros([ROWS_M, WIDTH], gl.float32, layout=o_layout)
        zero_s = gl.zeros([ROWS_M, TILE], gl.float32, layout=s_layout)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), TILE)
        if num_tiles > 0:
            mbarrier.wait(ready.index(0), 0)
            kv = kv_smem.index(0)
            if lo + TILE > hi:
                clear_keys_past(kv, lo, hi)
            s = _scores(q_smem, qr_smem, kv, pe_smem.index(0), zero_s)
            s = warpgroup_mma_wait(0, deps=(s, q_smem, qr_smem, kv, pe_smem.index(0)))[0]
            if num_full == 0:
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, lo, row_end, True, qk_scale)
            else:
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, lo, row_end, False, qk_scale)
            p_op = gl.convert_layout(p.to(kv_smem.dtype), p_layout)
            for j in range(1, num_tiles):
                stage = j % RING
                prev = (j - 1) % RING
                first = lo + j * TILE
                # The previous tile's P @ V first: its stage goes back to the loader as
                # soon as it is done, while this tile's scores run.
                o_tok = warpgroup_mma(p_op, kv_smem.index(prev), o, is_async=True)
                mbarrier.wait(ready.index(stage), (j // RING) & 1)
                kv = kv_smem.index(stage)
                if first + TILE > hi:
                    clear_keys_past(kv, first, hi)
                s_tok = _scores(q_smem, qr_smem, kv, pe_smem.index(stage), zero_s)
                # Done once P @ V is (the scores' two MMAs may still run): the stage goes back.
                o = warpgroup_mma_wait(2, deps=(o_tok, p_op, kv_smem.index(prev)))[0]
                mbarrier.arrive(empty.index(prev), count=1)
                s = warpgroup_mma_wait(0, deps=(s_tok, kv, pe_smem.index(stage)))[0]
                if j >= num_full:
                    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, first, row_end, True, qk_scale)
                else:
                    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, first, row_end, False, qk_scale)
                o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p_op = gl.convert_layout(p.to(kv_smem.dtype), p_layout)
            last = (num_tiles - 1) % RING
            o = warpgroup_mma(p_op, kv_smem.index(last), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o, p_op, kv_smem.index(last)))[0]
            mbarrier.arrive(empty.index(last), count=1)
        return o, m_i, l_i

    @gluon.jit
    def _consumer_partition(
        q_ptr, qr_ptr, q_smem, qr_smem, kv_smem, pe_smem, ready, empty, out_ptr,
        partial_out_ptr, partial_lse_ptr, lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        stride_qt, stride_qh, stride_rt, stride_rh, stride_ot, stride_oh, stride_lt, stride_lh,
        qk_scale, shape: DecodeShape,
    ):  # fmt: skip
        """Two warpgroups: the program's rows against its key tiles, then the store."""
        TILE: gl.constexpr = kv_smem.type.shape[1]
        WIDTH: gl.constexpr = kv_smem.type.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, TILE // 2, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, WIDTH // 2, 16]
        )
        req = gl.program_id(1)
        q_start = gl.load(cu_seqlens_q_ptr + req)
        q_len = gl.load(cu_seqlens_q_ptr + req + 1) - q_start
        seq_len = gl.load(seq_lens_ptr + req)
        lo, hi = split_key_range(seq_len, TILE)
        _stage_queries(q_ptr, qr_ptr, q_smem, qr_smem, q_start, q_len,
                       stride_qt, stride_qh, stride_rt, stride_rh, shape)  # fmt: skip
        # A row of query token t sees keys below context + t + 1.
        context_len = seq_len - q_len
        r = gl.arange(0, shape.block_m, layout=gl.SliceLayout(1, s_layout))
        row_end = gl.minimum(context_len + _query_rows(r, q_len, shape)[0] + 1, hi)
        num_full = gl.maximum(gl.minimum(hi, context_len + 1) - lo, 0) // TILE
        o, m_i, l_i = _attend(
            q_smem, qr_smem, kv_smem, pe_smem, ready, empty, lo, hi, row_end,
            num_full, qk_scale, o_layout, s_layout,
        )  # fmt: skip
        _store_rows(o, m_i, l_i, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr, q_start,
                    q_len, stride_ot, stride_oh, stride_lt, stride_lh, shape)  # fmt: skip

    @gluon.jit
    def _store_rows(
        o, m_i, l_i, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr, q_start, q_len,
        stride_ot, stride_oh, stride_lt, stride_lh, shape: DecodeShape,
    ):  # fmt: skip
        """Normalize and write the real rows: to ``out`` (and ``lse``), or as this
        split's partial rows (output and log2-domain LSE) for the merge kernel."""
        layout: gl.constexpr = o.type.layout
        WIDTH: gl.constexpr = o.type.shape[1]
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, layout))
        o = o / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
        r = gl.arange(0, shape.block_m, layout=gl.SliceLayout(1, layout))
        d = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        token_in_req, head, valid = _query_rows(r, q_len, shape)
        token = (q_start + token_in_req).to(gl.int64)
        row = (token * shape.num_heads + head) * gl.num_programs(2) + gl.program_id(2)
        if shape.split:
            dst = partial_out_ptr + row[:, None] * WIDTH + d[None, :]
            gl.store(dst, o, mask=valid[:, None])
        else:
            dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            gl.store(dst, o.to(out_ptr.dtype.element_ty), mask=valid[:, None])
        seen = l_i > 0.0  # a row that saw no key: output zeros, LSE -inf
        lse2 = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
        rs = gl.arange(0, shape.block_m, layout=l_i.type.layout)
        t_in_req, head_s, valid_s = _query_rows(rs, q_len, shape)
        token_s = (q_start + t_in_req).to(gl.int64)
        if shape.split:
            row_s = (token_s * shape.num_heads + head_s) * gl.num_programs(2) + gl.program_id(2)
            gl.store(partial_lse_ptr + row_s, lse2, mask=valid_s)
        elif shape.write_lse:
            lse_dst = lse_ptr + token_s * stride_lt + head_s * stride_lh
            gl.store(lse_dst, lse2 * 0.6931471805599453, mask=valid_s)  # natural log

    @gluon.jit
    def _wide_decode_kernel(
        q_ptr, qr_ptr, kv_desc, pe_desc, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr,
        cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, table_width, stride_bt,
        stride_qt, stride_qh, stride_rt, stride_rh, stride_ot, stride_oh, stride_lt, stride_lh,
        qk_scale, NUM_HEADS: gl.constexpr, ROWS: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr,
        TILE_M: gl.constexpr, TILE_N: gl.constexpr, RING: gl.constexpr,
        q_layout: gl.constexpr, qr_layout: gl.constexpr,
    ):  # fmt: skip
        PIECES: gl.constexpr = TILE_N // kv_desc.block_type.shape[0]
        WIDTH: gl.constexpr = kv_desc.block_type.shape[1]  # the latent, 512
        RWIDTH: gl.constexpr = pe_desc.block_type.shape[1]  # the rope, 64
        dtype: gl.constexpr = kv_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [TILE_M, WIDTH], q_layout)
        qr_smem = gl.allocate_shared_memory(dtype, [TILE_M, RWIDTH], qr_layout)
        kv_smem = gl.allocate_shared_memory(dtype, [RING, TILE_N, WIDTH], kv_desc.layout)
        pe_smem = gl.allocate_shared_memory(dtype, [RING, TILE_N, RWIDTH], pe_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(RING):
            mbarrier.init(ready.index(i), count=2 * PIECES)  # latent and rope: one each a piece
            mbarrier.init(empty.index(i), count=1)
        shape = DecodeShape(NUM_HEADS, NUM_HEADS, ROWS, TILE_M, BLOCK_SIZE, SPLIT, WRITE_LSE)
        consumer_args = (
            q_ptr, qr_ptr, q_smem, qr_smem, kv_smem, pe_smem, ready, empty, out_ptr,
            partial_out_ptr, partial_lse_ptr, lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
            stride_qt, stride_qh, stride_rt, stride_rh, stride_ot, stride_oh, stride_lt,
            stride_lh, qk_scale, shape,
        )  # fmt: skip
        load_args = (
            kv_desc, pe_desc, kv_smem, pe_smem, ready, empty, seq_lens_ptr, block_tables_ptr,
            table_width, stride_bt, shape,
        )  # fmt: skip
        gl.warp_specialize(
            [(_consumer_partition, consumer_args), (load_partition, load_args)], [1], [24]
        )
