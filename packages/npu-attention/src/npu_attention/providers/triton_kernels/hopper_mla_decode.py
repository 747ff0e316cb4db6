"""Absorbed MLA decode over a paged latent cache for Hopper GPUs, written in Gluon.

An absorbed MLA decode is multi-query attention with one wide "head": every query
head of a request scores its keys against the same latent rows (``kv_lora_rank``
512 + rope 64) and sums the first 512 columns of those rows as values. Its time is
memory's (a latent row is 1152 bytes at 16 bits) until the query heads are many
(128 heads: about 240 flops per byte). What this kernel takes from FlashMLA:

- the latent tile is loaded once into shared memory and read there by both
  ``Q @ K^T`` and ``P @ V`` (V is the tile's first 512 columns);
- one loader warp (the GQA decode's, ``hopper_decode.load_ring``) reads the block
  table one tile ahead and fetches each tile's pages with the tensor-memory
  accelerator into a ring of ``STAGES`` shared-memory stages, signalling each on an
  mbarrier, while the consumer warps compute;
- query heads x query tokens go on the rows of the matrix products (up to 64 rows:
  16 heads x 4 tokens, or 64 of 128 heads); more heads, or a small batch of many
  heads given fewer a program (``max_heads``), take several programs a request,
  launched side by side so that all but the first read the latents from the L2;
- a request's keys are split over programs so that the launch fills the
  multiprocessors (the provider picks the count), and a second kernel merges the
  splits by their log-sum-exps.

The consumer (4 warps for 16 rows, 8 for 32 or 64) keeps the query in shared memory
and streams its 64-column chunks through ``mma.sync``: a decode's rows are too few
for a warpgroup MMA without padding them to 64. The output accumulates in four
128-column chunks, so that no more than one chunk of V is in registers at a time.
Keys past the request's end in the last tile (unused page slots, which may hold
anything, NaN included) are zeroed in shared memory before ``P @ V`` reads them.

It covers ``kv_lora_rank`` 512, rope 64, float16 / bfloat16, pages of a power of two
from 8 tokens, 1 to 64 query rows a program (heads x tokens; spec decode tokens
causal among themselves), splits, and the optional log-sum-exp.
:func:`hopper_mla_decode_supported` says whether a call can take this path; the
caller checks the device (compute capability 9.x) and the Triton version.
"""

import torch

from npu_attention.providers.triton_kernels.mla_decode import merge_mla_splits
from npu_attention.providers.triton_kernels.utils import next_power_of_2, nvmma_shared_layout

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.core import _aggregate as aggregate

    from npu_attention.providers.triton_kernels.hopper_decode import load_ring, split_key_range

    HAVE_GLUON = True
except ImportError:  # older Triton, triton-ascend: the portable kernel serves
    HAVE_GLUON = False

_LOG2E = 1.4426950408889634
LATENT = 512  # kv_lora_rank the kernel takes
ROPE = 64  # qk_rope_head_dim the kernel takes
MAX_ROWS = 64  # query rows of a program: heads x query tokens
_SHARED_BYTES = 220 * 1024  # query rows and latent ring (H200: 227 KiB a block)
_MAX_STAGES = 8


def program_rows(
    num_heads: int, tokens_per_req: int, max_heads: int | None = None
) -> tuple[int, int]:
    """``(heads, block_m)`` of one program: the query heads it takes (at most the
    model's, rounded up to a power of two, and ``max_heads``, within ``MAX_ROWS`` rows
    of heads x tokens) and its row tile (16, 32 or 64)."""
    tokens = next_power_of_2(tokens_per_req)
    heads = max(1, min(next_power_of_2(num_heads), MAX_ROWS // tokens, max_heads or MAX_ROWS))
    return heads, max(16, next_power_of_2(heads * tokens_per_req))


def consumer_warps(block_m: int) -> int:
    """Warps of the consumer: 4 for 16 rows, 8 for 32 or 64 (two rows of four warps,
    each warp a quarter of the keys and of the output columns)."""
    return 4 if block_m <= 16 else 8


def max_stages(block_m: int, block_n: int) -> int:
    """The deepest ring of ``block_n``-key latent tiles that fits beside the query
    rows in ``_SHARED_BYTES`` (16-bit values), at most 8."""
    query_bytes = block_m * (LATENT + ROPE) * 2
    stage_bytes = block_n * (LATENT + ROPE) * 2
    return max(1, min(_MAX_STAGES, (_SHARED_BYTES - query_bytes) // stage_bytes))


def shape_supported(
    kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, block_size: int, rows: int
) -> bool:
    """Whether the kernel takes these widths, dtype, page size and ``rows`` query rows
    per request (heads x query tokens; more than ``MAX_ROWS`` take more programs, but
    one token's heads must fit one program): latent 512 + rope 64, fp16/bf16, a
    power-of-two page of at least 8 tokens."""
    return (
        kv_lora_rank == LATENT
        and rope_dim == ROPE
        and dtype in (torch.float16, torch.bfloat16)
        and block_size >= 8
        and block_size & (block_size - 1) == 0
        and rows >= 1
    )


def hopper_mla_decode_supported(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    out: torch.Tensor,
) -> bool:
    """Whether :func:`hopper_mla_decode` takes these tensors: Gluon present, CUDA
    tensors of one 16-bit dtype, :func:`shape_supported` widths, unit last strides,
    and cache planes whose pages a 2-D tensor descriptor can address (``[num_blocks *
    block_size, width]``, rows 16-byte aligned)."""
    if not HAVE_GLUON or q_latent.device.type != "cuda":
        return False
    dtype = q_latent.dtype
    if not shape_supported(kv_c.shape[-1], k_pe.shape[-1], dtype, kv_c.shape[1], 1):
        return False
    if any(t.dtype != dtype or t.stride(-1) != 1 for t in (q_rope, out)):
        return False
    return q_latent.stride(-1) == 1 and all(_pages_take_descriptor(c, dtype) for c in (kv_c, k_pe))


def _pages_take_descriptor(plane: torch.Tensor, dtype: torch.dtype) -> bool:
    if plane.dtype != dtype or plane.dim() != 3:
        return False
    _, block_size, _ = plane.shape
    stride_b, stride_t, stride_d = plane.stride()
    return (
        stride_d == 1
        and stride_b == block_size * stride_t
        and (stride_t * plane.element_size()) % 16 == 0
        and plane.data_ptr() % 16 == 0
    )


def hopper_mla_decode(
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
    block_n: int = 64,
    stages: int = 2,
    max_heads: int | None = None,
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
        block_n: keys per tile (32 or 64); stages: tiles in flight, at most
            :func:`max_stages`; max_heads: query heads a program takes at most
            (:func:`program_rows`).

    The caller checks :func:`hopper_mla_decode_supported`.
    """
    num_heads = q_latent.shape[1]
    if num_decodes == 0 or num_decode_tokens == 0:
        return
    heads, block_m = program_rows(num_heads, tokens_per_req, max_heads)
    block_size = kv_c.shape[1]
    page_rows = min(block_size, block_n)
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
    grid = (-(-num_heads // heads), num_decodes, num_splits)
    _hopper_mla_decode_kernel[grid](
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
        HEADS=heads,
        ROWS=heads * tokens_per_req,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        STAGES=max(1, min(stages, max_stages(block_m, block_n))),
        SPLIT=split,
        WRITE_LSE=write_lse,
        chunk_layout=nvmma_shared_layout(block_m, ROPE, dtype),
        **_registers(block_m),
    )
    if split:
        merge_mla_splits(out, partial_out, partial_lse, lse, num_decode_tokens, num_splits)


def _registers(block_m: int) -> dict[str, int]:
    """The launch's warps, and for 8 consumer warps a register cap at entry (168 for
    the 12 warps a block holds, the loader's group padded to four), which lets the
    consumers take 240 registers each when the loader gives its own back."""
    warps = consumer_warps(block_m)
    return {"num_warps": warps} if warps == 4 else {"num_warps": warps, "maxnreg": 168}


def _page_descriptor(plane: torch.Tensor, page_rows: int, dtype) -> "TensorDescriptor":
    """A 2-D descriptor over a cache plane seen as ``[num_blocks * block_size, width]``;
    a box is ``page_rows`` rows of one page."""
    num_blocks, block_size, width = plane.shape
    layout = nvmma_shared_layout(page_rows, width, dtype)
    return TensorDescriptor(
        plane, [num_blocks * block_size, width], [plane.stride(1), 1], [page_rows, width], layout
    )


if HAVE_GLUON:

    @aggregate
    class DecodeShape:
        """Compile-time sizes shared by the two partitions."""

        num_heads: gl.constexpr
        heads: gl.constexpr
        rows: gl.constexpr
        block_m: gl.constexpr
        block_size: gl.constexpr
        split: gl.constexpr
        write_lse: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, num_heads, heads, rows, block_m, block_size, split, write_lse):
            self.num_heads = gl.constexpr(num_heads)
            self.heads = gl.constexpr(heads)
            self.rows = gl.constexpr(rows)
            self.block_m = gl.constexpr(block_m)
            self.block_size = gl.constexpr(block_size)
            self.split = gl.constexpr(split)
            self.write_lse = gl.constexpr(write_lse)

    @gluon.jit
    def load_partition(
        kv_desc, pe_desc, kv_smem, pe_smem, ready, empty, seq_lens_ptr, block_tables_ptr,
        table_width, stride_bt, shape: DecodeShape,
    ):  # fmt: skip
        """One warp: each tile's latent and rope rows into the ring (one ``ready``
        barrier a stage for both; ``hopper_decode.load_ring``)."""
        load_ring(
            kv_desc, pe_desc, kv_smem, pe_smem, ready, ready, empty, gl.program_id(1), 0, 0,
            seq_lens_ptr, block_tables_ptr, table_width, stride_bt, shape.block_size,
            shape.split, shape.block_size,
        )  # fmt: skip

    @gluon.jit
    def _stage_queries(
        q_ptr, qr_ptr, q_smem, qr_smem, q_start, q_len,
        stride_qt, stride_qh, stride_rt, stride_rh, shape: DecodeShape,
    ):  # fmt: skip
        """The program's query rows into shared memory (row ``r``: query token ``r //
        heads`` of the request, head ``r % heads`` of the program's group), zeros past
        the request's tokens and the model's heads. Every chunk's load is issued before
        the first store: one trip to memory, not one a chunk."""
        plain: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        CHUNK: gl.constexpr = qr_smem.type.shape[1]
        r = gl.arange(0, shape.block_m, layout=gl.SliceLayout(1, plain))
        d = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, plain))
        token_in_req = r // shape.heads
        head = gl.program_id(0) * shape.heads + r % shape.heads
        valid = ((r < shape.rows) & (token_in_req < q_len) & (head < shape.num_heads))[:, None]
        token = (q_start + token_in_req).to(gl.int64)
        q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        qr_rows = qr_ptr + token[:, None] * stride_rt + head[:, None] * stride_rh + d[None, :]
        rope = gl.load(qr_rows, mask=valid, other=0.0)
        c0 = gl.load(q_rows, mask=valid, other=0.0)
        c1 = gl.load(q_rows + CHUNK, mask=valid, other=0.0)
        c2 = gl.load(q_rows + 2 * CHUNK, mask=valid, other=0.0)
        c3 = gl.load(q_rows + 3 * CHUNK, mask=valid, other=0.0)
        c4 = gl.load(q_rows + 4 * CHUNK, mask=valid, other=0.0)
        c5 = gl.load(q_rows + 5 * CHUNK, mask=valid, other=0.0)
        c6 = gl.load(q_rows + 6 * CHUNK, mask=valid, other=0.0)
        c7 = gl.load(q_rows + 7 * CHUNK, mask=valid, other=0.0)
        qr_smem.store(rope)
        q_smem.index(0).store(c0)
        q_smem.index(1).store(c1)
        q_smem.index(2).store(c2)
        q_smem.index(3).store(c3)
        q_smem.index(4).store(c4)
        q_smem.index(5).store(c5)
        q_smem.index(6).store(c6)
        q_smem.index(7).store(c7)

    @gluon.jit
    def clear_keys_past(kv_tile, first, hi):
        """Zero the rows of keys at or past ``hi`` of a latent tile in shared memory
        (slots past the request: unfetched, or whatever the page holds there)."""
        BLOCK_N: gl.constexpr = kv_tile.type.shape[0]
        WIDTH: gl.constexpr = kv_tile.type.shape[1]
        CHUNK: gl.constexpr = 64
        plain: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        keys = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, plain))
        zeros = gl.zeros([BLOCK_N, CHUNK], kv_tile.dtype, plain)
        for c in gl.static_range(WIDTH // CHUNK):
            part = kv_tile.slice(c * CHUNK, CHUNK, dim=1)
            part.store(gl.where((keys < hi)[:, None], part.load(plain), zeros))
        fence_async_shared()  # the ring's next TMA write follows these stores
        gl.thread_barrier()

    @gluon.jit
    def _scores(q_smem, qr_smem, kv_tile, pe_tile, zero_s, a_layout: gl.constexpr,
                b_layout: gl.constexpr):  # fmt: skip
        """``Q @ K^T`` of a tile: the latent's 64-column chunks, then the rope."""
        CHUNK: gl.constexpr = qr_smem.type.shape[1]
        CHUNKS: gl.constexpr = q_smem.type.shape[0]
        s = zero_s
        for c in gl.static_range(CHUNKS):
            q = q_smem.index(c).load(a_layout)
            k = kv_tile.slice(c * CHUNK, CHUNK, dim=1).permute((1, 0)).load(b_layout)
            s = mma_v2(q, k, s)
        return mma_v2(qr_smem.load(a_layout), pe_tile.permute((1, 0)).load(b_layout), s)

    @gluon.jit
    def _consumer_partition(
        q_ptr, qr_ptr, q_smem, qr_smem, kv_smem, pe_smem, ready, empty, out_ptr,
        partial_out_ptr, partial_lse_ptr, lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        stride_qt, stride_qh, stride_rt, stride_rh, stride_ot, stride_oh, stride_lt, stride_lh,
        qk_scale, shape: DecodeShape,
    ):  # fmt: skip
        """The consumer warps: the program's rows against its key tiles, then the store."""
        STAGES: gl.constexpr = kv_smem.type.shape[0]
        BLOCK_N: gl.constexpr = kv_smem.type.shape[1]
        BLOCK_M: gl.constexpr = shape.block_m
        V_CHUNK: gl.constexpr = kv_smem.type.shape[2] // 4
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[gl.num_warps() // 4, 4], instr_shape=[16, 8]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        req = gl.program_id(1)
        q_start = gl.load(cu_seqlens_q_ptr + req)
        q_len = gl.load(cu_seqlens_q_ptr + req + 1) - q_start
        seq_len = gl.load(seq_lens_ptr + req)
        lo, hi = split_key_range(seq_len, BLOCK_N)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        _stage_queries(q_ptr, qr_ptr, q_smem, qr_smem, q_start, q_len,
                       stride_qt, stride_qh, stride_rt, stride_rh, shape)  # fmt: skip
        gl.thread_barrier()
        # Row r (query token r // heads) sees keys below context + token + 1.
        context_len = seq_len - q_len
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
        row_end = gl.minimum(context_len + r // shape.heads + 1, hi)
        num_full = gl.maximum(gl.minimum(hi, context_len + 1) - lo, 0) // BLOCK_N

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, mma))
        acc0 = gl.zeros([BLOCK_M, V_CHUNK], gl.float32, layout=mma)
        acc1 = gl.zeros([BLOCK_M, V_CHUNK], gl.float32, layout=mma)
        acc2 = gl.zeros([BLOCK_M, V_CHUNK], gl.float32, layout=mma)
        acc3 = gl.zeros([BLOCK_M, V_CHUNK], gl.float32, layout=mma)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
        for j in range(num_tiles):
            stage = j % STAGES
            first = lo + j * BLOCK_N
            mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
            kv = kv_smem.index(stage)
            if first + BLOCK_N > hi:
                clear_keys_past(kv, first, hi)
            s = _scores(q_smem, qr_smem, kv, pe_smem.index(stage), zero_s, a_layout, b_layout)
            if j >= num_full:
                keys = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
                s = gl.where(keys[None, :] < row_end[:, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s * qk_scale - m_safe[:, None])
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            p_op = gl.convert_layout(p.to(kv_smem.dtype), a_layout)
            scale = alpha[:, None]
            acc0 = mma_v2(p_op, kv.slice(0, V_CHUNK, dim=1).load(b_layout), acc0 * scale)
            acc1 = mma_v2(p_op, kv.slice(V_CHUNK, V_CHUNK, dim=1).load(b_layout), acc1 * scale)
            acc2 = mma_v2(p_op, kv.slice(2 * V_CHUNK, V_CHUNK, dim=1).load(b_layout), acc2 * scale)
            acc3 = mma_v2(p_op, kv.slice(3 * V_CHUNK, V_CHUNK, dim=1).load(b_layout), acc3 * scale)
            mbarrier.arrive(empty.index(stage), count=1)
        _store_rows(acc0, acc1, acc2, acc3, m_i, l_i, out_ptr, partial_out_ptr, partial_lse_ptr,
                    lse_ptr, q_start, q_len, stride_ot, stride_oh, stride_lt, stride_lh,
                    shape)  # fmt: skip

    @gluon.jit
    def _store_chunk(acc, c: gl.constexpr, l_i, where, shape: DecodeShape):
        """Columns ``[c * width, (c + 1) * width)`` of the normalized rows; ``where``:
        the destinations and each row's token, head, partial row and validity."""
        out_ptr, partial_out_ptr, token, head, row, valid, stride_ot, stride_oh = where
        layout: gl.constexpr = acc.type.layout
        WIDTH: gl.constexpr = acc.type.shape[1]
        d = c * WIDTH + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        out = acc / gl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if shape.split:
            dst = partial_out_ptr + row[:, None] * (4 * WIDTH) + d[None, :]
            gl.store(dst, out, mask=valid[:, None])
        else:
            dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            gl.store(dst, out.to(out_ptr.dtype.element_ty), mask=valid[:, None])

    @gluon.jit
    def _store_rows(
        acc0, acc1, acc2, acc3, m_i, l_i, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr,
        q_start, q_len, stride_ot, stride_oh, stride_lt, stride_lh, shape: DecodeShape,
    ):  # fmt: skip
        """Normalize and write the real rows: to ``out`` (and ``lse``), or as this
        split's partial rows (output and log2-domain LSE) for the merge kernel."""
        layout: gl.constexpr = acc0.type.layout
        r = gl.arange(0, shape.block_m, layout=gl.SliceLayout(1, layout))
        token_in_req = r // shape.heads
        head = gl.program_id(0) * shape.heads + r % shape.heads
        valid = (r < shape.rows) & (token_in_req < q_len) & (head < shape.num_heads)
        token = (q_start + token_in_req).to(gl.int64)
        row = (token * shape.num_heads + head) * gl.num_programs(2) + gl.program_id(2)
        where = (out_ptr, partial_out_ptr, token, head, row, valid, stride_ot, stride_oh)
        _store_chunk(acc0, 0, l_i, where, shape)
        _store_chunk(acc1, 1, l_i, where, shape)
        _store_chunk(acc2, 2, l_i, where, shape)
        _store_chunk(acc3, 3, l_i, where, shape)
        seen = l_i > 0.0  # a row that saw no key: output zeros, LSE -inf
        lse2 = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
        if shape.split:
            gl.store(partial_lse_ptr + row, lse2, mask=valid)
        elif shape.write_lse:
            lse_dst = lse_ptr + token * stride_lt + head * stride_lh
            gl.store(lse_dst, lse2 * 0.6931471805599453, mask=valid)  # natural log

    @gluon.jit
    def _hopper_mla_decode_kernel(
        q_ptr, qr_ptr, kv_desc, pe_desc, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr,
        cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, table_width, stride_bt,
        stride_qt, stride_qh, stride_rt, stride_rh, stride_ot, stride_oh, stride_lt, stride_lh,
        qk_scale, NUM_HEADS: gl.constexpr, HEADS: gl.constexpr, ROWS: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr,
        chunk_layout: gl.constexpr,
    ):  # fmt: skip
        PIECES: gl.constexpr = BLOCK_N // kv_desc.block_type.shape[0]
        WIDTH: gl.constexpr = kv_desc.block_type.shape[1]  # the latent, 512
        CHUNK: gl.constexpr = pe_desc.block_type.shape[1]  # the rope, 64: a query chunk
        dtype: gl.constexpr = kv_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [WIDTH // CHUNK, BLOCK_M, CHUNK], chunk_layout)
        qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, CHUNK], chunk_layout)
        kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, WIDTH], kv_desc.layout)
        pe_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, CHUNK], pe_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=2 * PIECES)  # latent and rope: one each a piece
            mbarrier.init(empty.index(i), count=1)
        shape = DecodeShape(NUM_HEADS, HEADS, ROWS, BLOCK_M, BLOCK_SIZE, SPLIT, WRITE_LSE)
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
            [(_consumer_partition, consumer_args), (load_partition, load_args)], [1], [32]
        )
