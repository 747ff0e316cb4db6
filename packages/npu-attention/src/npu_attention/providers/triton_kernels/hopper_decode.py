"""Decode attention over a paged KV cache for Hopper GPUs, written in Gluon.

A decode program (one request, one KV head, one share of its keys) has little to
compute: the query heads of one KV head times its query tokens, a few rows against
every key. Its time is memory's: the trips for its lengths and page ids before the
first K/V arrive, then the stream of K and V. The portable kernel issues its loads
from the warps that compute, after each tile's page id; this kernel gives the loads
to a warp of their own:

- one loader warp reads the block table one tile ahead and fetches each tile's pages
  with the tensor-memory accelerator into a ring of shared-memory stages (``STAGES``
  tiles in flight), signalling each stage on an mbarrier;
- a consumer of four (or eight) warps computes ``Q @ K^T``, the online softmax and
  ``P @ V`` with ``mma.sync`` (a decode's rows are too few for a warpgroup MMA) and
  frees each stage once its K and V are in registers.

It covers one-token and speculative decodes (query tokens causal among themselves),
GQA, head sizes 64/128/256 (16-bit), page sizes that are powers of two from 8 tokens
up, splits of the keys (merged by the portable merge kernel) and the optional
log-sum-exp. Sliding windows and soft caps stay on the portable kernel.

8-bit pages (``npu_attention.kv_quant``: int8 or e4m3 codes, per-tensor or
per-token-head scales) travel through TMA as they are, half the bytes a tile, and are
converted to float16 in the consumer's registers (e4m3 by ``cvt``, int8 by
``dequant.py``'s arithmetic), whatever the query's dtype: the query, scaled first, is
rounded to float16 and both products run in it. Keys go straight from shared memory
into the score MMA's operand (four codes of a row a thread, query columns permuted
alike), values through a 16-bit copy in the operand's layout. Per-token-head key
scales multiply the scores' columns and value scales the probabilities: the loader
copies each tile's scales into rings of their own (``cp.async``, completing on the
tile's key barrier); per-tensor scales join the query's scale and the output.

Pages may be token-major (vLLM's ``[num_blocks, block_size, kv_heads, head_size]``,
a token's KV heads side by side) or head-major (each KV head's tokens of a page
contiguous, vLLM's HND order). A KV head's rows are ``head_size``-element pieces
``kv_heads`` rows apart in the first and one run in the second; 8-bit decodes read
the second faster (``benchmarks/README.md``).
:func:`hopper_decode_supported` says whether a call can take this path; the caller
checks the device (compute capability 9.x).
"""

import torch

from npu_attention.providers.triton_kernels.paged_attention import merge_splits, split_buffers
from npu_attention.providers.triton_kernels.utils import nvmma_shared_layout

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.core import _aggregate as aggregate

    from npu_attention.providers.triton_kernels.dequant import dequant_gl, e4m3_to_f16_cvt_gl

    HAVE_GLUON = True
except ImportError:  # older Triton, triton-ascend: the portable kernel serves
    HAVE_GLUON = False

_LOG2E = 1.4426950408889634
HEAD_SIZES = (64, 128, 256)
MAX_ROWS = 64  # query rows of a program: query heads of a KV head x query tokens
_RING_BYTES = 192 * 1024  # shared memory for the K/V stages (H100: 227 KiB a block)
EIGHT_BIT_PAGES = (torch.int8, torch.float8_e4m3fn)
_GL_PAGES = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv} if HAVE_GLUON else {}
_MAX_STAGES = 8


def key_tile(head_size: int, block_n: int = 64) -> int:
    """Keys per stage: ``block_n``, at most 64 at head size 256."""
    return block_n if head_size <= 128 else min(block_n, 64)


def max_stages(head_size: int, block_n: int = 64, element_size: int = 2) -> int:
    """The deepest K/V ring of ``block_n``-key tiles of ``element_size``-byte elements:
    as many as ``_RING_BYTES`` holds, at most 8."""
    stage_bytes = 2 * key_tile(head_size, block_n) * head_size * element_size
    return max(1, min(_MAX_STAGES, _RING_BYTES // stage_bytes))


def shape_supported(head_size: int, dtype: torch.dtype, block_size: int, rows: int) -> bool:
    """Whether the kernel takes a head size, dtype, page size and ``rows`` query rows
    per program (query heads of a KV head x query tokens of a request): a head size of
    ``HEAD_SIZES``, fp16/bf16, a power-of-two page of at least 8 tokens, at most
    ``MAX_ROWS`` rows."""
    return (
        head_size in HEAD_SIZES
        and dtype in (torch.float16, torch.bfloat16)
        and block_size >= 8
        and block_size & (block_size - 1) == 0
        and rows <= MAX_ROWS
    )


def hopper_decode_supported(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    rows: int,
    k_scale: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`hopper_decode` takes ``query``/``out`` ``[tokens, heads,
    head_size]`` against caches ``[num_blocks, block_size, kv_heads, head_size]`` with
    ``rows`` query rows per program: Gluon present, CUDA tensors, :func:`shape_supported`,
    and caches whose rows a 2-D tensor descriptor can address (``[num_blocks *
    block_size, kv_heads * head_size]``, 16-byte aligned), in the query's dtype or,
    with ``k_scale`` (8-bit pages), both int8 or both float8_e4m3fn."""
    if not HAVE_GLUON or query.device.type != "cuda":
        return False
    if not shape_supported(query.shape[-1], query.dtype, key_cache.shape[1], rows):
        return False
    if out.dtype != query.dtype or out.stride(-1) != 1 or query.stride(-1) != 1:
        return False
    pages = query.dtype
    if k_scale is not None:
        pages = key_cache.dtype
        if pages not in EIGHT_BIT_PAGES:
            return False
    order = _page_order(key_cache, pages)
    return order is not None and _page_order(value_cache, pages) == order


def _pages_take_descriptor(cache: torch.Tensor, dtype: torch.dtype) -> bool:
    return _page_order(cache, dtype) is not None


def _page_order(cache: torch.Tensor, dtype: torch.dtype) -> str | None:
    """How a 2-D tensor descriptor addresses ``cache`` ``[num_blocks, block_size,
    kv_heads, head_size]`` of ``dtype``: ``"token_major"`` (a page's tokens one after
    another, each with all its KV heads: rows ``[num_blocks * block_size, kv_heads *
    head_size]``), ``"head_major"`` (each KV head's tokens of a page contiguous: rows
    ``[num_blocks * kv_heads * block_size, head_size]``), or ``None`` (neither, or not
    16-byte aligned)."""
    if cache.dtype != dtype or cache.dim() != 4 or cache.data_ptr() % 16:
        return None
    num_blocks, block_size, kv_heads, head_size = cache.shape
    stride_b, stride_t, stride_h, stride_d = cache.stride()
    if stride_d != 1:
        return None
    if (
        stride_h == head_size
        and stride_b == block_size * stride_t
        and stride_t >= kv_heads * head_size
        and (stride_t * cache.element_size()) % 16 == 0
    ):
        return "token_major"
    if (
        stride_t == head_size
        and stride_h == block_size * head_size
        and stride_b == kv_heads * stride_h
        and (head_size * cache.element_size()) % 16 == 0
        and num_blocks * kv_heads * block_size < 2**31
    ):
        return "head_major"
    return None


def hopper_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float,
    tokens_per_req: int,
    num_splits: int = 1,
    lse: torch.Tensor | None = None,
    stages: int = 2,
    block_n: int = 64,
    num_warps: int = 4,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    maxnreg: int | None = None,
) -> None:
    """Decode attention of each request's query tokens over its cached keys, into ``out``.

    Args:
        query: ``[tokens, heads, head_size]`` fp16/bf16; request ``r`` holds rows
            ``cu_seqlens_q[r]:cu_seqlens_q[r + 1]``, at most ``tokens_per_req`` of them
            (``1 + num_speculative_tokens``), causal among themselves.
        key_cache, value_cache: ``[num_blocks, block_size, kv_heads, head_size]``, in
            the query's dtype, or 8-bit pages (int8 / float8_e4m3fn) with scales.
        out: ``[tokens, heads, head_size]`` (any strides, last one 1).
        cu_seqlens_q: int32 ``[num_reqs + 1]``; seq_lens: int32 ``[num_reqs]`` (context +
            new tokens); block_tables: int32 ``[num_reqs, max_blocks]``; all on the device.
        num_splits: programs along each request's keys; their partial results are
            merged by a second kernel.
        lse: optional float32 ``[>= tokens, heads]``: each real row's natural-log
            log-sum-exp, ``-inf`` for a row that sees no key.
        stages: K/V tiles in flight, at most :func:`max_stages`.
        block_n: keys per tile (64 or 128; at most 64 at head size 256).
        num_warps: warps of the consumer (4 or 8), which split each tile's keys.
        k_scale, v_scale: float32 scales of 8-bit pages: one element each (per tensor)
            or ``[num_blocks, block_size, kv_heads]`` of any strides (per token and
            head); ``None`` for pages in the query's dtype.
        maxnreg: registers a thread at most (``None``: the compiler's choice, which takes
            the whole register file); 128 lets two programs share a multiprocessor.

    The caller checks :func:`hopper_decode_supported`. Rows past ``cu_seqlens_q[-1]``
    are left untouched.
    """
    num_tokens, num_heads, head_size = query.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return
    _, block_size, num_kv_heads, _ = key_cache.shape
    queries_per_kv = num_heads // num_kv_heads
    rows = queries_per_kv * tokens_per_req
    block_n = key_tile(head_size, block_n)
    page_rows = min(block_size, block_n)
    dtype = gl.float16 if query.dtype == torch.float16 else gl.bfloat16
    kv_quant, scale_args = _scale_args(k_scale, v_scale, out)
    page_dtype = dtype if kv_quant == 0 else _GL_PAGES[key_cache.dtype]
    head_major = _page_order(key_cache, key_cache.dtype) == "head_major"
    k_desc = _page_descriptor(key_cache, page_rows, page_dtype, head_major)
    v_desc = _page_descriptor(value_cache, page_rows, page_dtype, head_major)
    split = num_splits > 1
    partial_out, partial_lse = split_buffers(out, num_splits, head_size) if split else (out, out)
    write_lse = lse is not None and not split
    lse_arg, lse_strides = (lse, tuple(lse.stride())) if write_lse else (out, (0, 0))
    _hopper_decode_kernel[(num_reqs, num_kv_heads, num_splits)](
        query,
        k_desc,
        v_desc,
        out,
        partial_out,
        partial_lse,
        lse_arg,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        block_tables.shape[1],
        *query.stride()[:2],
        *out.stride()[:2],
        *lse_strides,
        block_tables.stride(0),
        scale * _LOG2E,
        *scale_args,
        NUM_HEADS=num_heads,
        QUERIES_PER_KV=queries_per_kv,
        ROWS=rows,
        BLOCK_M=max(16, 1 << (rows - 1).bit_length()),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        STAGES=min(stages, max_stages(head_size, block_n, key_cache.element_size())),
        SPLIT=split,
        WRITE_LSE=write_lse,
        KV_QUANT=kv_quant,
        HEAD_MAJOR=head_major,
        num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    if split:
        merge_splits(out, partial_out, partial_lse, lse, cu_seqlens_q, num_reqs, num_splits)


def _scale_args(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, placeholder: torch.Tensor
) -> tuple[int, tuple]:
    """``KV_QUANT`` (0: 16-bit pages, 1: per-tensor scales, 2: per token and head) and
    the kernel's scale arguments: the two pointers and their block, slot and head strides."""
    if k_scale is None or v_scale is None:
        return 0, (placeholder, placeholder, *(0,) * 6)
    if k_scale.dim() == 3:
        return 2, (k_scale, v_scale, *k_scale.stride(), *v_scale.stride())
    return 1, (k_scale, v_scale, *(0,) * 6)


def _page_descriptor(
    cache: torch.Tensor, page_rows: int, dtype, head_major: bool = False
) -> "TensorDescriptor":
    """A 2-D descriptor over ``cache`` in its order (:func:`_page_order`): rows
    ``[num_blocks * block_size, kv_heads * head_size]`` or, ``head_major``,
    ``[num_blocks * kv_heads * block_size, head_size]`` (one KV head: the same rows); a
    box is ``page_rows`` rows of one page and one KV head."""
    num_blocks, block_size, kv_heads, head_size = cache.shape
    layout = nvmma_shared_layout(page_rows, head_size, dtype)
    if head_major:
        rows, row_stride = [num_blocks * kv_heads * block_size, head_size], head_size
    else:
        rows, row_stride = [num_blocks * block_size, kv_heads * head_size], cache.stride(1)
    return TensorDescriptor(cache, rows, [row_stride, 1], [page_rows, head_size], layout)


if HAVE_GLUON:
    # Probabilities times per-token-head value scales, in float16: times 16 keeps them
    # normal for scales down to 4e-6 / p, and finite for scales up to 4096 (|v| < 5e5).
    _P_SCALE_F16 = gl.constexpr(16.0)

    @aggregate
    class _Shape:
        """Compile-time sizes shared by the two partitions."""

        num_heads: gl.constexpr
        queries_per_kv: gl.constexpr
        rows: gl.constexpr
        block_m: gl.constexpr
        block_size: gl.constexpr
        split: gl.constexpr
        write_lse: gl.constexpr
        head_major: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, num_heads, queries_per_kv, rows, block_m, block_size, split, write_lse,
                     head_major):  # fmt: skip
            self.num_heads = gl.constexpr(num_heads)
            self.queries_per_kv = gl.constexpr(queries_per_kv)
            self.rows = gl.constexpr(rows)
            self.block_m = gl.constexpr(block_m)
            self.block_size = gl.constexpr(block_size)
            self.split = gl.constexpr(split)
            self.write_lse = gl.constexpr(write_lse)
            self.head_major = gl.constexpr(head_major)

        @gluon.constexpr_function
        def page_stride(self):
            """Descriptor rows from one page to the next."""
            kv_heads = self.num_heads // self.queries_per_kv
            return gl.constexpr(self.block_size * (kv_heads if self.head_major else 1))

    @gluon.jit
    def head_place(shape: _Shape, kv_head, HEAD: gl.constexpr):
        """Where KV head ``kv_head``'s rows of a page start in the descriptor: ``(row,
        column)`` offsets (pages token-major: its columns; head-major: its rows)."""
        if shape.head_major:
            return kv_head * shape.block_size, 0
        else:
            return 0, kv_head * HEAD

    @gluon.jit
    def split_key_range(seq_len, BLOCK_N: gl.constexpr):
        """This program's keys ``[lo, hi)``: an equal share, in whole tiles, of the
        request's ``seq_len`` keys over the programs along axis 2."""
        split = gl.program_id(2)
        per_split = gl.cdiv(gl.cdiv(seq_len, gl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = gl.minimum(seq_len, lo + per_split)
        return lo, hi

    @gluon.jit
    def tile_pages(
        block_table_row, table_width, first_key, hi, offs,
        PAGE_ROWS: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ):  # fmt: skip
        """Page ids of the pieces ``offs`` (``PAGE_ROWS`` keys each) of the tile that
        starts at key ``first_key``; pieces at or past key ``hi`` read 0."""
        keys = first_key + offs * PAGE_ROWS
        entry = keys // BLOCK_SIZE
        return gl.load(block_table_row + entry, mask=(keys < hi) & (entry < table_width), other=0)

    @gluon.jit
    def first_tile_pages(
        block_table_row, table_width, seq_len_ptr, offs,
        PAGE_ROWS: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
        SPLIT: gl.constexpr,
    ):  # fmt: skip
        """A loader's start: its request's length, its keys ``[lo, hi)``
        (:func:`split_key_range`), its tile count, and the page ids of its first tile
        (see :func:`tile_pages`); unsplit, those need no length and are read alongside it."""
        if not SPLIT:
            pages = tile_pages(block_table_row, table_width, 0, table_width * BLOCK_SIZE, offs,
                               PAGE_ROWS, BLOCK_SIZE)  # fmt: skip
        seq_len = gl.load(seq_len_ptr)
        lo, hi = split_key_range(seq_len, BLOCK_N)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        if SPLIT:
            pages = tile_pages(block_table_row, table_width, lo, hi, offs, PAGE_ROWS, BLOCK_SIZE)
        return pages, lo, hi, num_tiles

    @gluon.jit
    def _fetch_piece(desc, smem, ready, stage, piece, coord, valid):
        """Piece ``piece`` of stage ``stage`` through TMA when ``valid``; otherwise an
        arrival without bytes, so that the stage still completes."""
        PAGE_ROWS: gl.constexpr = desc.block_type.shape[0]
        mbarrier.expect(ready.index(stage), desc.block_type.nbytes, pred=valid)
        mbarrier.arrive(ready.index(stage), pred=not valid)
        tma.async_copy_global_to_shared(
            desc, coord, ready.index(stage),
            smem.index(stage).slice(piece * PAGE_ROWS, PAGE_ROWS), pred=valid,
        )  # fmt: skip

    @gluon.jit
    def load_ring(
        k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, empty, req, row0, col, seq_lens_ptr,
        block_tables_ptr, table_width, stride_bt, BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr,
        PAGE_STRIDE: gl.constexpr,
    ):  # fmt: skip
        """A decode's loader warp (this kernel's and the MLA decode's): request ``req``'s
        block table read one tile ahead, each tile's pages of two caches (``k`` and
        ``v``: page ``p``'s rows from ``p * PAGE_STRIDE + row0``, columns from ``col``; MLA:
        the latent and the rope) into their rings of
        stages, a piece past the request's keys an arrival without bytes. Each stage's
        ``k_ready`` and ``v_ready`` count one arrival a piece (one barrier for both:
        two); the consumer frees a stage on ``empty``."""
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        PAGE_ROWS: gl.constexpr = k_desc.block_type.shape[0]
        PIECES: gl.constexpr = BLOCK_N // PAGE_ROWS
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        row = block_tables_ptr + req.to(gl.int64) * stride_bt
        offs = gl.arange(0, PIECES, layout=layout)
        pages, lo, hi, num_tiles = first_tile_pages(
            row, table_width, seq_lens_ptr + req, offs, PAGE_ROWS, BLOCK_SIZE, BLOCK_N, SPLIT
        )
        for j in range(num_tiles):
            first = lo + j * BLOCK_N
            upcoming = tile_pages(
                row, table_width, first + BLOCK_N, hi, offs, PAGE_ROWS, BLOCK_SIZE
            )
            stage = j % STAGES
            mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)  # fresh: counts as freed
            for i in gl.static_range(PIECES):
                key = first + i * PAGE_ROWS
                page = gl.sum(gl.where(offs == i, pages, 0), axis=0)
                coord = [page * PAGE_STRIDE + row0 + key % BLOCK_SIZE, col]
                _fetch_piece(k_desc, k_smem, k_ready, stage, i, coord, key < hi)
                _fetch_piece(v_desc, v_smem, v_ready, stage, i, coord, key < hi)
            pages = upcoming

    @gluon.jit
    def _load_partition(
        k_desc, v_desc, k_smem, v_smem, bars, seq_lens_ptr, block_tables_ptr,
        table_width, stride_bt, shape: _Shape,
    ):  # fmt: skip
        """One warp: the program's KV head of each tile's pages into the ring."""
        k_ready, v_ready, empty = bars
        row0, col = head_place(shape, gl.program_id(1), k_smem.type.shape[2])
        load_ring(
            k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, empty, gl.program_id(0), row0, col,
            seq_lens_ptr, block_tables_ptr, table_width, stride_bt, shape.block_size, shape.split,
            shape.page_stride(),
        )  # fmt: skip

    @gluon.jit
    def _query_rows(q_ptr, q_start, q_len, kv_head, stride_qt, stride_qh, HEAD: gl.constexpr,
                    shape: _Shape, layout: gl.constexpr):  # fmt: skip
        """The program's query rows ``[BLOCK_M, HEAD]`` (row ``r``: query token ``r //
        queries_per_kv`` of the request, head ``r % queries_per_kv`` of the KV head's
        group), zeros past the request's tokens; and for each row its token and head."""
        r = gl.arange(0, shape.block_m, layout=gl.SliceLayout(1, layout))
        d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, layout))
        token_in_req = r // shape.queries_per_kv
        head = kv_head * shape.queries_per_kv + r % shape.queries_per_kv
        valid = (r < shape.rows) & (token_in_req < q_len)
        token = (q_start + token_in_req).to(gl.int64)
        ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        return gl.load(ptrs, mask=valid[:, None], other=0.0)

    @gluon.jit
    def _values(v_smem, stage, first, hi, MASKED: gl.constexpr, layout: gl.constexpr):
        """The stage's V tile in ``layout``; with ``MASKED``, rows of keys at or past
        ``hi`` (pieces not fetched or past the request) read as zeros."""
        BLOCK_N: gl.constexpr = v_smem.type.shape[1]
        HEAD: gl.constexpr = v_smem.type.shape[2]
        if MASKED:
            plain: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
            v = v_smem.index(stage).load(plain)
            keys = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, plain))
            v = gl.where((keys < hi)[:, None], v, gl.zeros([BLOCK_N, HEAD], v.dtype, plain))
            return gl.convert_layout(v, layout)
        else:
            return v_smem.index(stage).load(layout)

    @gluon.jit
    def _consumer_partition(
        q_ptr, k_smem, v_smem, bars, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr,
        cu_seqlens_q_ptr, seq_lens_ptr, stride_qt, stride_qh, stride_ot, stride_oh,
        stride_lt, stride_lh, qk_scale, shape: _Shape,
    ):  # fmt: skip
        """One warpgroup: the program's rows against its key tiles, then the store."""
        k_ready, v_ready, empty = bars
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        HEAD: gl.constexpr = k_smem.type.shape[2]
        BLOCK_M: gl.constexpr = shape.block_m
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[1, gl.num_warps()], instr_shape=[16, 8]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        plain: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        req = gl.program_id(0)
        kv_head = gl.program_id(1)
        q_start = gl.load(cu_seqlens_q_ptr + req)
        q_len = gl.load(cu_seqlens_q_ptr + req + 1) - q_start
        seq_len = gl.load(seq_lens_ptr + req)
        lo, hi = split_key_range(seq_len, BLOCK_N)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        q = _query_rows(q_ptr, q_start, q_len, kv_head, stride_qt, stride_qh, HEAD, shape, plain)
        q = gl.convert_layout(q, a_layout)
        # Row r (query token r // queries_per_kv) sees keys below context + token + 1.
        context_len = seq_len - q_len
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
        row_end = gl.minimum(context_len + r // shape.queries_per_kv + 1, hi)
        num_full = gl.maximum(gl.minimum(hi, context_len + 1) - lo, 0) // BLOCK_N

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, mma))
        acc = gl.zeros([BLOCK_M, HEAD], gl.float32, layout=mma)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
        for j in range(num_tiles):
            stage = j % STAGES
            phase = (j // STAGES) & 1
            first = lo + j * BLOCK_N
            mbarrier.wait(k_ready.index(stage), phase)
            k = k_smem.index(stage).permute((1, 0)).load(b_layout)
            s = mma_v2(q, k, zero_s)
            masked = j >= num_full
            if masked:
                keys = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
                s = gl.where(keys[None, :] < row_end[:, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s * qk_scale - m_safe[:, None])
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            mbarrier.wait(v_ready.index(stage), phase)
            if masked:
                v = _values(v_smem, stage, first, hi, True, b_layout)
            else:
                v = _values(v_smem, stage, first, hi, False, b_layout)
            mbarrier.arrive(empty.index(stage), count=1)
            p_op = gl.convert_layout(p.to(k_smem.dtype), a_layout)
            acc = mma_v2(p_op, v, acc * alpha[:, None])
        _store_rows(
            acc, m_i, l_i, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr, q_start, q_len,
            kv_head, stride_ot, stride_oh, stride_lt, stride_lh, shape,
        )  # fmt: skip

    @aggregate
    class _Scales:
        """The scales of 8-bit pages: ``kv_quant`` 1, one float32 element each at
        ``k_ptr``/``v_ptr``; 2, per token and KV head (block, slot and head strides)."""

        k_ptr: gl.tensor
        v_ptr: gl.tensor
        k_block: gl.tensor
        k_slot: gl.tensor
        k_head: gl.tensor
        v_block: gl.tensor
        v_slot: gl.tensor
        v_head: gl.tensor
        kv_quant: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, k_ptr, v_ptr, k_block, k_slot, k_head, v_block, v_slot, v_head,
                     kv_quant):  # fmt: skip
            self.k_ptr = k_ptr
            self.v_ptr = v_ptr
            self.k_block = k_block
            self.k_slot = k_slot
            self.k_head = k_head
            self.v_block = v_block
            self.v_slot = v_slot
            self.v_head = v_head
            self.kv_quant = gl.constexpr(kv_quant)

    @gluon.jit
    def _copy_scales(scales: _Scales, ks_smem, vs_smem, ready, pages, kv_head, first, hi, offs,
                     BLOCK_SIZE: gl.constexpr):  # fmt: skip
        """``cp.async`` of the key and value scales of keys ``first + offs`` (on
        ``pages``; zeros at or past ``hi``) into ``ks_smem``/``vs_smem``; ``ready``
        completes only once they have landed."""
        keys = first + offs
        slot = keys % BLOCK_SIZE
        block = pages.to(gl.int64)
        k_at = block * scales.k_block + slot * scales.k_slot + kv_head * scales.k_head
        v_at = block * scales.v_block + slot * scales.v_slot + kv_head * scales.v_head
        async_copy.async_copy_global_to_shared(ks_smem, scales.k_ptr + k_at, mask=keys < hi)
        async_copy.async_copy_global_to_shared(vs_smem, scales.v_ptr + v_at, mask=keys < hi)
        async_copy.mbarrier_arrive(ready)

    @gluon.jit
    def _load_partition_scaled(
        k_desc, v_desc, k_smem, v_smem, ks_smem, vs_smem, bars, seq_lens_ptr, block_tables_ptr,
        table_width, stride_bt, shape: _Shape, scales: _Scales,
    ):  # fmt: skip
        """``_load_partition`` over pages with per-token-head scales: each tile's scales
        copied into their rings before its pages are fetched (the page of every key read
        one tile ahead, as the pieces' pages are)."""
        k_ready, v_ready, empty = bars
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        HEAD: gl.constexpr = k_smem.type.shape[2]
        PAGE_ROWS: gl.constexpr = k_desc.block_type.shape[0]
        PIECES: gl.constexpr = BLOCK_N // PAGE_ROWS
        BLOCK_SIZE: gl.constexpr = shape.block_size
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        key_layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
        req = gl.program_id(0)
        kv_head = gl.program_id(1)
        row = block_tables_ptr + req.to(gl.int64) * stride_bt
        offs = gl.arange(0, PIECES, layout=layout)
        key_offs = gl.arange(0, BLOCK_N, layout=key_layout)
        pages, lo, hi, num_tiles = first_tile_pages(
            row, table_width, seq_lens_ptr + req, offs, PAGE_ROWS, BLOCK_SIZE, BLOCK_N,
            shape.split,
        )  # fmt: skip
        key_pages = tile_pages(row, table_width, lo, hi, key_offs, 1, BLOCK_SIZE)
        row0, col = head_place(shape, kv_head, HEAD)
        PAGE_STRIDE: gl.constexpr = shape.page_stride()
        for j in range(num_tiles):
            first = lo + j * BLOCK_N
            upcoming = tile_pages(
                row, table_width, first + BLOCK_N, hi, offs, PAGE_ROWS, BLOCK_SIZE
            )
            upcoming_keys = tile_pages(
                row, table_width, first + BLOCK_N, hi, key_offs, 1, BLOCK_SIZE
            )
            stage = j % STAGES
            mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)  # fresh: counts as freed
            _copy_scales(
                scales, ks_smem.index(stage), vs_smem.index(stage), k_ready.index(stage),
                key_pages, kv_head, first, hi, key_offs, BLOCK_SIZE,
            )  # fmt: skip
            for i in gl.static_range(PIECES):
                key = first + i * PAGE_ROWS
                page = gl.sum(gl.where(offs == i, pages, 0), axis=0)
                coord = [page * PAGE_STRIDE + row0 + key % BLOCK_SIZE, col]
                _fetch_piece(k_desc, k_smem, k_ready, stage, i, coord, key < hi)
                _fetch_piece(v_desc, v_smem, v_ready, stage, i, coord, key < hi)
            pages = upcoming
            key_pages = upcoming_keys

    @gluon.jit
    def _to_f16(codes):
        """8-bit codes as float16: e4m3 by Hopper's paired conversion, int8 by
        arithmetic (``dequant.py``)."""
        if codes.dtype == gl.float8e4nv:
            return e4m3_to_f16_cvt_gl(codes)
        else:
            return dequant_gl(codes, gl.float16)

    @gluon.jit
    def _consumer_partition_8bit(
        q_ptr, k_smem, v_smem, ks_smem, vs_smem, bars, out_ptr, partial_out_ptr,
        partial_lse_ptr, lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr, stride_qt, stride_qh,
        stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, shape: _Shape, scales: _Scales,
    ):  # fmt: skip
        """``_consumer_partition`` over 8-bit pages, its products in float16 whatever the
        query's dtype (codes convert to float16 in fewer instructions than to bfloat16,
        and with more mantissa): keys loaded four codes of a row a thread into the score
        MMA's operand and converted there (the query's columns take the same order:
        ``k_width`` 4 on both operands), values converted in a row-wise layout and moved
        into their operand's; scales applied to the scores and probabilities (per token
        and head, read a tile ahead) or to the query and the output (per tensor);
        per-token-head scales come from the loader's rings."""
        k_ready, v_ready, empty = bars
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        HEAD: gl.constexpr = k_smem.type.shape[2]
        BLOCK_M: gl.constexpr = shape.block_m
        DTYPE: gl.constexpr = gl.float16
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[1, gl.num_warps()], instr_shape=[16, 8]
        )
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
        k_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        v_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        plain: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        ROW_THREADS: gl.constexpr = HEAD // 16  # 16 codes (16 bytes) a thread
        rows: gl.constexpr = gl.BlockedLayout(
            [1, 16], [32 // ROW_THREADS, ROW_THREADS], [gl.num_warps(), 1], [1, 0]
        )
        cols: gl.constexpr = gl.SliceLayout(0, mma)
        req = gl.program_id(0)
        kv_head = gl.program_id(1)
        q_start = gl.load(cu_seqlens_q_ptr + req)
        q_len = gl.load(cu_seqlens_q_ptr + req + 1) - q_start
        seq_len = gl.load(seq_lens_ptr + req)
        lo, hi = split_key_range(seq_len, BLOCK_N)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        q = _query_rows(q_ptr, q_start, q_len, kv_head, stride_qt, stride_qh, HEAD, shape, plain)
        context_len = seq_len - q_len
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
        row_end = gl.minimum(context_len + r // shape.queries_per_kv + 1, hi)
        num_full = gl.maximum(gl.minimum(hi, context_len + 1) - lo, 0) // BLOCK_N
        out_scale = 1.0
        if scales.kv_quant == 1:
            qk_scale = qk_scale * gl.load(scales.k_ptr)
            out_scale = gl.load(scales.v_ptr)
        p_scale = 1.0
        if scales.kv_quant == 2:
            p_scale = _P_SCALE_F16
            out_scale = out_scale / _P_SCALE_F16
        # Scaled before rounding to float16: the scores come out in the exp2 domain, and
        # a query element needs |q| < 65504 / qk_scale rather than < 65504.
        q = gl.convert_layout((q.to(gl.float32) * qk_scale).to(DTYPE), q_layout)
        offs = gl.arange(0, BLOCK_N, layout=cols)

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, mma))
        acc = gl.zeros([BLOCK_M, HEAD], gl.float32, layout=mma)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
        for j in range(num_tiles):
            stage = j % STAGES
            phase = (j // STAGES) & 1
            first = lo + j * BLOCK_N
            mbarrier.wait(k_ready.index(stage), phase)
            k = k_smem.index(stage).permute((1, 0)).load(k_layout)
            s = mma_v2(q, _to_f16(k), zero_s)
            if scales.kv_quant == 2:
                s = s * ks_smem.index(stage).load(cols)[None, :]
            masked = j >= num_full
            if masked:
                keys = first + offs
                s = gl.where(keys[None, :] < row_end[:, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_safe[:, None])
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            mbarrier.wait(v_ready.index(stage), phase)
            # Rows past the keys (never fetched, or stale) meet p = 0: int8 codes are all
            # finite, e4m3 codes there are zeroed after the conversion.
            v = v_smem.index(stage).load(rows)
            if scales.kv_quant == 2:
                p = p * (vs_smem.index(stage).load(cols) * p_scale)[None, :]
            mbarrier.arrive(empty.index(stage), count=1)
            v = _to_f16(v)
            if v_smem.dtype == gl.float8e4nv:  # noqa: SIM102 (constexpr, then runtime)
                if masked:  # NaN codes past the keys would meet p = 0 as NaN
                    keys_v = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rows))
                    v = gl.where((keys_v < hi)[:, None], v, 0.0)
            v = gl.convert_layout(v, v_layout)
            p_op = gl.convert_layout(p.to(DTYPE), p_layout)
            acc = mma_v2(p_op, v, acc * alpha[:, None])
        _store_rows(
            acc, m_i, l_i, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr, q_start, q_len,
            kv_head, stride_ot, stride_oh, stride_lt, stride_lh, shape, out_scale,
        )  # fmt: skip

    @gluon.jit
    def _store_rows(
        acc, m_i, l_i, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr, q_start, q_len,
        kv_head, stride_ot, stride_oh, stride_lt, stride_lh, shape: _Shape, out_scale=1.0,
    ):  # fmt: skip
        """Normalize and write the real rows: to ``out`` (and ``lse``), or as this
        split's partial rows (output and log2-domain LSE) for the merge kernel."""
        layout: gl.constexpr = acc.type.layout
        BLOCK_M: gl.constexpr = acc.type.shape[0]
        HEAD: gl.constexpr = acc.type.shape[1]
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, layout))
        token_in_req = r // shape.queries_per_kv
        head = kv_head * shape.queries_per_kv + r % shape.queries_per_kv
        valid = (r < shape.rows) & (token_in_req < q_len)
        token = (q_start + token_in_req).to(gl.int64)
        seen = l_i > 0.0  # a row that saw no key: output zeros, LSE -inf
        out = acc * (out_scale / gl.where(seen, l_i, 1.0))[:, None]
        lse2 = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
        if shape.split:
            row = (token * shape.num_heads + head) * gl.num_programs(2) + gl.program_id(2)
            gl.store(partial_lse_ptr + row, lse2, mask=valid)
            gl.store(partial_out_ptr + row[:, None] * HEAD + d[None, :], out, mask=valid[:, None])
        else:
            dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            gl.store(dst, out.to(out_ptr.dtype.element_ty), mask=valid[:, None])
            if shape.write_lse:
                gl.store(
                    lse_ptr + token * stride_lt + head * stride_lh,
                    lse2 * 0.6931471805599453,  # natural log
                    mask=valid,
                )

    # Values the scales' aggregate holds as tensors: never specialized into constants.
    _SCALE_ARGS = (
        "stride_ksb", "stride_kst", "stride_ksh", "stride_vsb", "stride_vst", "stride_vsh",
    )  # fmt: skip

    @gluon.jit(do_not_specialize=_SCALE_ARGS)
    def _hopper_decode_kernel(
        q_ptr, k_desc, v_desc, out_ptr, partial_out_ptr, partial_lse_ptr, lse_ptr,
        cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, table_width,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, stride_bt, qk_scale,
        ks_ptr, vs_ptr, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
        NUM_HEADS: gl.constexpr, QUERIES_PER_KV: gl.constexpr, ROWS: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr,
        KV_QUANT: gl.constexpr, HEAD_MAJOR: gl.constexpr,
    ):  # fmt: skip
        HEAD: gl.constexpr = k_desc.block_type.shape[1]
        PIECES: gl.constexpr = BLOCK_N // k_desc.block_type.shape[0]
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD], v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=PIECES)  # one arrival per piece
            mbarrier.init(v_ready.index(i), count=PIECES)
            mbarrier.init(empty.index(i), count=1)
        bars = (k_ready, v_ready, empty)
        shape = _Shape(
            NUM_HEADS, QUERIES_PER_KV, ROWS, BLOCK_M, BLOCK_SIZE, SPLIT, WRITE_LSE, HEAD_MAJOR
        )
        load_args = (
            k_desc, v_desc, k_smem, v_smem, bars, seq_lens_ptr, block_tables_ptr,
            table_width, stride_bt, shape,
        )  # fmt: skip
        if KV_QUANT == 0:
            consumer_args = (
                q_ptr, k_smem, v_smem, bars, out_ptr, partial_out_ptr, partial_lse_ptr,
                lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr, stride_qt, stride_qh, stride_ot,
                stride_oh, stride_lt, stride_lh, qk_scale, shape,
            )  # fmt: skip
            gl.warp_specialize(
                [(_consumer_partition, consumer_args), (_load_partition, load_args)], [1], [32]
            )
        else:
            scales = _Scales(
                ks_ptr, vs_ptr, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst,
                stride_vsh, KV_QUANT,
            )  # fmt: skip
            ring: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], ring)
            vs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], ring)
            consumer_args = (
                q_ptr, k_smem, v_smem, ks_smem, vs_smem, bars, out_ptr, partial_out_ptr,
                partial_lse_ptr, lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr, stride_qt, stride_qh,
                stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, shape, scales,
            )  # fmt: skip
            if KV_QUANT == 1:
                gl.warp_specialize(
                    [(_consumer_partition_8bit, consumer_args), (_load_partition, load_args)],
                    [1],
                    [32],
                )
            else:
                load_args = (
                    k_desc, v_desc, k_smem, v_smem, ks_smem, vs_smem, bars, seq_lens_ptr,
                    block_tables_ptr, table_width, stride_bt, shape, scales,
                )  # fmt: skip
                gl.warp_specialize(
                    [
                        (_consumer_partition_8bit, consumer_args),
                        (_load_partition_scaled, load_args),
                    ],
                    [1],
                    [32],
                )
