"""Absorbed MLA decode of many query rows a request for Hopper GPUs: warpgroup MMAs.

With 128 query heads (DeepSeek served with data-parallel attention) a decode does
about 240 flops per byte of latent cache: its time is the tensor cores', and the
``mma.sync`` consumer of ``hopper_mla_decode.py`` leaves them half idle. This kernel
gives each program 64 of a request's query rows (its tokens x heads, token-major: 64
heads of one token; with 3 tokens of 128 heads, six full programs) and computes both
products with asynchronous warpgroup MMAs (``wgmma``) from shared memory:

- one loader warp fetches each 64-key tile of latent (512) and rope (64) rows with the
  tensor-memory accelerator into a ring of two stages, in 64-column chunks, each on
  its own barrier, so that the scores start on a tile's first chunk while the rest
  arrive;
- the query rows stay in shared memory for the whole program; the latent tile is read
  there by both ``Q @ K^T`` and ``P @ V`` (V: its first 512 columns);
- the first consumer warpgroup computes every tile's scores (64 x 64, so that each
  MMA reads as many key columns as query rows) and its softmax alone: row maxima and
  sums stay within the warpgroup, with no exchange across warpgroups. It hands ``P``
  and the rescale factors to the second warpgroup through shared memory (one
  handover a tile, on a pair of barriers) and accumulates output columns
  ``[256, 512)`` with ``P`` from registers;
- the second warpgroup accumulates columns ``[0, 256)`` with ``P`` from shared
  memory (128 float32 registers a thread in each);
- the order on the tensor cores: the previous tile's ``P`` is handed over first, so
  that the second warpgroup's half of ``P @ V`` runs first and gives the stage's left
  four chunks back to the loader; then this tile's scores; then the first
  warpgroup's half, which runs during this tile's softmax and gives the right four
  chunks and the rope back (each half of a stage on its own barrier), so that the
  tensor cores have work during the softmax and the next fetch starts on the chunks
  that the next scores read first;
- a request's keys are split over programs to fill the multiprocessors, and the merge
  kernel of ``mla_decode.py`` combines the splits by their log-sum-exps.

It covers ``kv_lora_rank`` 512, rope 64, float16 / bfloat16, pages of a power of two
from 8 tokens, requests of more than 32 query rows (heads x tokens; spec decode
tokens causal among themselves), splits and the optional log-sum-exp. Keys past a
request's end in its last tile (unused page slots, which may hold anything, NaN included) are zeroed in
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
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from npu_attention.providers.triton_kernels.hopper_decode import (
        first_tile_pages,
        split_key_range,
        tile_pages,
    )
    from npu_attention.providers.triton_kernels.hopper_mla_decode import (
        DecodeShape,
        clear_keys_past,
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
    kv_desc = _page_descriptor(kv_c, page_rows, dtype, ROPE)
    pe_desc = _page_descriptor(k_pe, page_rows, dtype, ROPE)
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
        LATENT_W=LATENT,
        q_layout=nvmma_shared_layout(BLOCK_M, LATENT, dtype),
        qr_layout=nvmma_shared_layout(BLOCK_M, ROPE, dtype),
        kv_layout=nvmma_shared_layout(BLOCK_N, LATENT, dtype),
        p_layout=nvmma_shared_layout(BLOCK_M, BLOCK_N, dtype),
        num_warps=4,
        maxnreg=168,
    )
    if split:
        merge_mla_splits(out, partial_out, partial_lse, lse, num_decode_tokens, num_splits)


def _page_descriptor(
    plane: torch.Tensor, page_rows: int, dtype, box_width: int
) -> "TensorDescriptor":
    """A 2-D descriptor over a cache plane seen as ``[num_blocks * block_size, width]``;
    a box is ``page_rows`` rows of one page, ``box_width`` columns."""
    num_blocks, block_size, width = plane.shape
    layout = nvmma_shared_layout(page_rows, box_width, dtype)
    return TensorDescriptor(
        plane,
        [num_blocks * block_size, width],
        [plane.stride(1), 1],
        [page_rows, box_width],
        layout,
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
    def _scores(q_smem, qr_smem, kv_tile, pe_tile, zero_s, ready, base, phase):
        """Issue ``Q @ K^T`` of a tile (asynchronous), each 64-column chunk of the
        latent as soon as its barrier ``ready[base + c]`` says it arrived, then the
        rope (``ready[base + 8]``)."""
        CH: gl.constexpr = qr_smem.type.shape[1]
        NCH: gl.constexpr = q_smem.type.shape[1] // CH
        s = zero_s
        for c in gl.static_range(NCH):
            mbarrier.wait(ready.index(base + c), phase)
            s = warpgroup_mma(q_smem.slice(c * CH, CH, dim=1),
                              kv_tile.slice(c * CH, CH, dim=1).permute((1, 0)), s,
                              use_acc=c > 0, is_async=True)  # fmt: skip
        mbarrier.wait(ready.index(base + NCH), phase)
        return warpgroup_mma(qr_smem, pe_tile.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _wait_tile(ready, base, phase, NBARS: gl.constexpr):
        """Wait until every chunk of a tile arrived."""
        for c in gl.static_range(NBARS):
            mbarrier.wait(ready.index(base + c), phase)

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
    def _tile_softmax(s, m_i, l_i, first, row_end, masked, qk_scale):
        """:func:`_softmax`, masked where ``masked`` (a run-time flag) says so."""
        if masked:
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, first, row_end, True, qk_scale)
        else:
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, first, row_end, False, qk_scale)
        return p, alpha, m_i, l_i

    @gluon.jit
    def _hand_over(p16, row_values, p_smem, row_smem, p_ready, p_free, n):
        """Message ``n`` to the other warpgroup: ``P`` (or nothing) and one value a row,
        once it has read message ``n - 1``."""
        mbarrier.wait(p_free, (n & 1) ^ 1)  # fresh: counts as read
        if p16 is not None:
            p_smem.store(p16)
        row_smem.store(row_values)
        fence_async_shared()  # the other warpgroup's MMA reads P next
        gl.thread_barrier()
        mbarrier.arrive(p_ready, count=1)

    @gluon.constexpr_function
    def _acc_layout(columns):
        """One warpgroup's accumulator layout for ``columns`` output columns."""
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 16]
        )

    @gluon.jit
    def _request(cu_seqlens_q_ptr, seq_lens_ptr, TILE: gl.constexpr):
        """The program's request: its first query row, query tokens, keys, and this
        split's keys ``[lo, hi)``."""
        req = gl.program_id(1)
        q_start = gl.load(cu_seqlens_q_ptr + req)
        q_len = gl.load(cu_seqlens_q_ptr + req + 1) - q_start
        seq_len = gl.load(seq_lens_ptr + req)
        lo, hi = split_key_range(seq_len, TILE)
        return q_start, q_len, seq_len, lo, hi

    @gluon.jit
    def _scorer_partition(
        q_ptr, qr_ptr, q_smem, qr_smem, kv_smem, pe_smem, p_smem, row_smem, bars, out_ptr,
        partial_out_ptr, partial_lse_ptr, lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        stride_qt, stride_qh, stride_rt, stride_rh, stride_ot, stride_oh, stride_lt, stride_lh,
        qk_scale, shape: DecodeShape,
    ):  # fmt: skip
        """The first warpgroup: every tile's scores and softmax, ``P`` and the rescale
        handed to the second warpgroup, and output columns ``[256, 512)``."""
        ready, empty, p_ready, p_free = bars
        RING: gl.constexpr = kv_smem.type.shape[0]
        TILE: gl.constexpr = kv_smem.type.shape[1]
        HALF: gl.constexpr = kv_smem.type.shape[2] // 2
        NBARS: gl.constexpr = ready.type.shape[0] // RING
        s_layout: gl.constexpr = _acc_layout(TILE)
        o_layout: gl.constexpr = _acc_layout(HALF)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_start, q_len, seq_len, lo, hi = _request(cu_seqlens_q_ptr, seq_lens_ptr, TILE)
        _stage_queries(q_ptr, qr_ptr, q_smem, qr_smem, q_start, q_len,
                       stride_qt, stride_qh, stride_rt, stride_rh, shape)  # fmt: skip
        # A row of query token t sees keys below context + t + 1.
        context_len = seq_len - q_len
        r = gl.arange(0, shape.block_m, layout=gl.SliceLayout(1, s_layout))
        row_end = gl.minimum(context_len + _query_rows(r, q_len, shape)[0] + 1, hi)
        num_full = gl.maximum(gl.minimum(hi, context_len + 1) - lo, 0) // TILE
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), TILE)
        m_i = gl.full(
            [shape.block_m], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout)
        )
        l_i = gl.zeros([shape.block_m], gl.float32, layout=gl.SliceLayout(1, s_layout))
        o = gl.zeros([shape.block_m, HALF], gl.float32, layout=o_layout)
        zero_s = gl.zeros([shape.block_m, TILE], gl.float32, layout=s_layout)
        if num_tiles > 0:
            kv = kv_smem.index(0)
            if lo + TILE > hi:
                _wait_tile(ready, 0, 0, NBARS)
                clear_keys_past(kv, lo, hi)
            s = _scores(q_smem, qr_smem, kv, pe_smem.index(0), zero_s, ready, 0, 0)
            s = warpgroup_mma_wait(0, deps=(s, q_smem, qr_smem, kv, pe_smem.index(0)))[0]
            p, alpha, m_i, l_i = _tile_softmax(s, m_i, l_i, lo, row_end, num_full == 0, qk_scale)
            p16 = p.to(kv_smem.dtype)
            p_op = gl.convert_layout(p16, p_layout)
            for j in range(1, num_tiles):
                stage = j % RING
                prev = (j - 1) % RING
                first = lo + j * TILE
                phase = (j // RING) & 1
                kv = kv_smem.index(stage)
                # The previous tile's P to the second warpgroup, whose left half of
                # P @ V goes first on the tensor cores and frees the stage's left
                # chunks; then this tile's scores, then the right half, which runs
                # during this tile's softmax.
                _hand_over(p16, alpha, p_smem, row_smem, p_ready, p_free, j - 1)
                if first + TILE > hi:
                    _wait_tile(ready, stage * NBARS, phase, NBARS)
                    clear_keys_past(kv, first, hi)
                s_tok = _scores(q_smem, qr_smem, kv, pe_smem.index(stage), zero_s, ready,
                                stage * NBARS, phase)  # fmt: skip
                o_tok = warpgroup_mma(p_op, kv_smem.index(prev).slice(HALF, HALF, dim=1), o,
                                      is_async=True)  # fmt: skip
                s = warpgroup_mma_wait(1, deps=(s_tok, kv, pe_smem.index(stage)))[0]
                p, alpha, m_i, l_i = _tile_softmax(s, m_i, l_i, first, row_end, j >= num_full,
                                                   qk_scale)  # fmt: skip
                o = warpgroup_mma_wait(0, deps=(o_tok, p_op, kv_smem.index(prev)))[0]
                mbarrier.arrive(empty.index(2 * prev + 1), count=1)
                o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p16 = p.to(kv_smem.dtype)
                p_op = gl.convert_layout(p16, p_layout)
            last = (num_tiles - 1) % RING
            _hand_over(p16, alpha, p_smem, row_smem, p_ready, p_free, num_tiles - 1)
            o = warpgroup_mma(p_op, kv_smem.index(last).slice(HALF, HALF, dim=1), o,
                              is_async=True)  # fmt: skip
            o = warpgroup_mma_wait(0, deps=(o, p_op, kv_smem.index(last)))[0]
            mbarrier.arrive(empty.index(2 * last + 1), count=1)
        _hand_over(None, l_i, p_smem, row_smem, p_ready, p_free, num_tiles)  # the row sums
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        _store_half(o, l_o, HALF, out_ptr, partial_out_ptr, q_start, q_len, stride_ot,
                    stride_oh, shape)  # fmt: skip
        _store_lse(m_i, l_i, partial_lse_ptr, lse_ptr, q_start, q_len, stride_lt, stride_lh,
                   shape)  # fmt: skip

    @gluon.jit
    def _pv_partition(
        kv_smem, p_smem, row_smem, bars, out_ptr, partial_out_ptr, cu_seqlens_q_ptr,
        seq_lens_ptr, stride_ot, stride_oh, shape: DecodeShape,
    ):  # fmt: skip
        """The second warpgroup: output columns ``[0, 256)``, each tile's ``P`` and
        rescale taken from the first warpgroup."""
        _, empty, p_ready, p_free = bars
        RING: gl.constexpr = kv_smem.type.shape[0]
        TILE: gl.constexpr = kv_smem.type.shape[1]
        HALF: gl.constexpr = kv_smem.type.shape[2] // 2
        o_layout: gl.constexpr = _acc_layout(HALF)
        row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        q_start, q_len, _, lo, hi = _request(cu_seqlens_q_ptr, seq_lens_ptr, TILE)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), TILE)
        o = gl.zeros([shape.block_m, HALF], gl.float32, layout=o_layout)
        for j in range(num_tiles):
            stage = j % RING
            mbarrier.wait(p_ready, j & 1)
            o = o * row_smem.load(row_layout)[:, None]
            v = kv_smem.index(stage).slice(0, HALF, dim=1)
            o = warpgroup_mma(p_smem, v, o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o, p_smem, v))[0]
            mbarrier.arrive(p_free, count=1)
            mbarrier.arrive(empty.index(2 * stage), count=1)
        mbarrier.wait(p_ready, num_tiles & 1)
        l_o = row_smem.load(row_layout)
        _store_half(o, l_o, 0, out_ptr, partial_out_ptr, q_start, q_len, stride_ot, stride_oh,
                    shape)  # fmt: skip

    @gluon.jit
    def _store_half(
        o, l_o, col0, out_ptr, partial_out_ptr, q_start, q_len, stride_ot, stride_oh,
        shape: DecodeShape,
    ):  # fmt: skip
        """Normalize the real rows of output columns ``[col0, col0 + HALF)`` and write
        them: to ``out``, or as this split's partial rows for the merge kernel."""
        layout: gl.constexpr = o.type.layout
        HALF: gl.constexpr = o.type.shape[1]
        o = o / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
        r = gl.arange(0, shape.block_m, layout=gl.SliceLayout(1, layout))
        d = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
        token_in_req, head, valid = _query_rows(r, q_len, shape)
        token = (q_start + token_in_req).to(gl.int64)
        if shape.split:
            row = (token * shape.num_heads + head) * gl.num_programs(2) + gl.program_id(2)
            dst = partial_out_ptr + row[:, None] * (2 * HALF) + d[None, :]
            gl.store(dst, o, mask=valid[:, None])
        else:
            dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            gl.store(dst, o.to(out_ptr.dtype.element_ty), mask=valid[:, None])

    @gluon.jit
    def _store_lse(m_i, l_i, partial_lse_ptr, lse_ptr, q_start, q_len, stride_lt, stride_lh,
                   shape: DecodeShape):  # fmt: skip
        """Each real row's log-sum-exp: this split's (log2 domain) for the merge
        kernel, or the natural-log one into ``lse``; ``-inf`` for a row that saw no key."""
        seen = l_i > 0.0
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
    def _load_chunks(
        kv_desc, pe_desc, kv_smem, pe_smem, ready, empty, seq_lens_ptr, block_tables_ptr,
        table_width, stride_bt, shape: DecodeShape,
    ):  # fmt: skip
        """One warp: each tile's 64-column chunks of latent rows, then its rope rows,
        into the ring, each chunk on its own barrier (a piece past the request's keys
        an arrival without bytes); the second warpgroup frees a stage's left four
        chunks on ``empty[2 * stage]``, the first its right four and the rope on
        ``empty[2 * stage + 1]``."""
        RING: gl.constexpr = kv_smem.type.shape[0]
        TILE: gl.constexpr = kv_smem.type.shape[1]
        WIDTH: gl.constexpr = kv_smem.type.shape[2]
        PAGE_ROWS: gl.constexpr = kv_desc.block_type.shape[0]
        CH: gl.constexpr = kv_desc.block_type.shape[1]
        NCH: gl.constexpr = WIDTH // CH
        PIECES: gl.constexpr = TILE // PAGE_ROWS
        BS: gl.constexpr = shape.block_size
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        req = gl.program_id(1)
        row = block_tables_ptr + req.to(gl.int64) * stride_bt
        offs = gl.arange(0, PIECES, layout=layout)
        pages, lo, hi, num_tiles = first_tile_pages(
            row, table_width, seq_lens_ptr + req, offs, PAGE_ROWS, BS, TILE, shape.split
        )
        for j in range(num_tiles):
            first = lo + j * TILE
            upcoming = tile_pages(row, table_width, first + TILE, hi, offs, PAGE_ROWS, BS)
            stage = j % RING
            for c in gl.static_range(NCH + 1):
                if c % (NCH // 2) == 0 and c < NCH:  # fresh barriers count as freed
                    mbarrier.wait(empty.index(2 * stage + c // (NCH // 2)), ((j // RING) & 1) ^ 1)
                bar = ready.index(stage * (NCH + 1) + c)
                for i in gl.static_range(PIECES):
                    key = first + i * PAGE_ROWS
                    page = gl.sum(gl.where(offs == i, pages, 0), axis=0)
                    valid = key < hi
                    mbarrier.expect(bar, kv_desc.block_type.nbytes, pred=valid)
                    mbarrier.arrive(bar, pred=not valid)
                    if c < NCH:
                        dst = kv_smem.index(stage).slice(c * CH, CH, dim=1)
                        tma.async_copy_global_to_shared(
                            kv_desc, [page * BS + key % BS, c * CH], bar,
                            dst.slice(i * PAGE_ROWS, PAGE_ROWS), pred=valid,
                        )  # fmt: skip
                    else:
                        tma.async_copy_global_to_shared(
                            pe_desc, [page * BS + key % BS, 0], bar,
                            pe_smem.index(stage).slice(i * PAGE_ROWS, PAGE_ROWS), pred=valid,
                        )  # fmt: skip
            pages = upcoming

    @gluon.jit
    def _wide_decode_kernel(
        q_ptr, qr_ptr, kv_desc, pe_desc, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr,
        cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, table_width, stride_bt,
        stride_qt, stride_qh, stride_rt, stride_rh, stride_ot, stride_oh, stride_lt, stride_lh,
        qk_scale, NUM_HEADS: gl.constexpr, ROWS: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr,
        TILE_M: gl.constexpr, TILE_N: gl.constexpr, RING: gl.constexpr, LATENT_W: gl.constexpr,
        q_layout: gl.constexpr, qr_layout: gl.constexpr, kv_layout: gl.constexpr,
        p_layout: gl.constexpr,
    ):  # fmt: skip
        PIECES: gl.constexpr = TILE_N // kv_desc.block_type.shape[0]
        RWIDTH: gl.constexpr = pe_desc.block_type.shape[1]  # the rope, 64
        NBARS: gl.constexpr = LATENT_W // RWIDTH + 1  # a tile's chunks: 8 of latent, the rope
        dtype: gl.constexpr = kv_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [TILE_M, LATENT_W], q_layout)
        qr_smem = gl.allocate_shared_memory(dtype, [TILE_M, RWIDTH], qr_layout)
        kv_smem = gl.allocate_shared_memory(dtype, [RING, TILE_N, LATENT_W], kv_layout)
        pe_smem = gl.allocate_shared_memory(dtype, [RING, TILE_N, RWIDTH], pe_desc.layout)
        p_smem = gl.allocate_shared_memory(dtype, [TILE_M, TILE_N], p_layout)
        row_smem = gl.allocate_shared_memory(
            gl.float32, [TILE_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        ready = gl.allocate_shared_memory(gl.int64, [RING * NBARS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2 * RING, 1], mbarrier.MBarrierLayout())
        flags = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(RING * NBARS):
            mbarrier.init(ready.index(i), count=PIECES)  # one arrival a piece
        for i in gl.static_range(2 * RING):
            mbarrier.init(empty.index(i), count=1)  # a stage's left / right columns
        mbarrier.init(flags.index(0), count=1)  # P and the rescale written
        mbarrier.init(flags.index(1), count=1)  # ... and read
        bars = (ready, empty, flags.index(0), flags.index(1))
        shape = DecodeShape(NUM_HEADS, NUM_HEADS, ROWS, TILE_M, BLOCK_SIZE, SPLIT, WRITE_LSE)
        scorer_args = (
            q_ptr, qr_ptr, q_smem, qr_smem, kv_smem, pe_smem, p_smem, row_smem, bars, out_ptr,
            partial_out_ptr, partial_lse_ptr, lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
            stride_qt, stride_qh, stride_rt, stride_rh, stride_ot, stride_oh, stride_lt,
            stride_lh, qk_scale, shape,
        )  # fmt: skip
        pv_args = (
            kv_smem, p_smem, row_smem, bars, out_ptr, partial_out_ptr, cu_seqlens_q_ptr,
            seq_lens_ptr, stride_ot, stride_oh, shape,
        )  # fmt: skip
        load_args = (
            kv_desc, pe_desc, kv_smem, pe_smem, ready, empty, seq_lens_ptr, block_tables_ptr,
            table_width, stride_bt, shape,
        )  # fmt: skip
        gl.warp_specialize(
            [
                (_pv_partition, pv_args),
                (_scorer_partition, scorer_args),
                (_load_chunks, load_args),
            ],
            [4, 1],
            [240, 24],
        )
