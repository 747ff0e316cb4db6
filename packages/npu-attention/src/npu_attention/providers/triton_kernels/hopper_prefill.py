"""Prefill attention over the step's own K/V rows for Hopper GPUs, written in Gluon.

The portable kernel in ``paged_attention.py`` leaves the schedule of its key loop to
the compiler, which waits for each tile's scores before it starts the softmax. This
kernel orders the work itself, in the way FlashAttention-3 does on Hopper:

- one loader warp fetches Q, K and V tiles with the tensor-memory accelerator into a
  ring of shared-memory stages, signalling each stage on an mbarrier;
- two consumer warpgroups each take 64 of the program's 128 query rows; each issues
  the next tile's scores (``Q @ K^T``) and this tile's ``P @ V`` as asynchronous
  warpgroup MMAs and computes the softmax while the ``P @ V`` runs;
- the grid is persistent, a program per multiprocessor going through (query tile,
  head) pairs; the loader fetches the next pair's tiles while the consumers finish
  the current one. From ``DYNAMIC_MIN_TOKENS`` tokens the pairs are handed out at run
  time (the loader takes the next from an atomic counter and passes it to the
  consumers through shared memory), the query heads of one KV head at a time, each
  head's query tiles longest first: the pairs running at once read few heads' keys
  and values, which stay in the L2, and the programs still finish together. Smaller
  steps keep a fixed stride, longest first and every head of a query tile in turn;
- where shared memory has room for it (head sizes 64 and 128 at 2 stages), each
  consumer writes its 64 finished rows into a shared-memory tile that the
  tensor-memory accelerator stores while the consumer goes on to its next pair;
  where only half of that tile fits (192 / 128 and 256 at 2 stages), the rows go
  through it in two halves of columns, the second store left running (rows of a
  request's last, partial tile are stored from registers, row by row masked, so that
  the next request's rows stay untouched).

It covers what a prefill without cached context needs: causal or not, any number of
requests packed along the token axis (varlen), GQA, head sizes 64/128/256 (16-bit),
the MHA form of an MLA prefill (192-wide queries and keys, read as 128 + 64 columns,
with 128-wide values), and the optional log-sum-exp output. Sliding windows and soft caps stay on the
portable kernel. Gluon, ``wgmma`` and TMA need Triton 3.5+ and compute capability 9.0
(sm_90a); :func:`hopper_prefill_supported` says whether a call can take this path.
"""

import torch

from npu_attention.providers.triton_kernels.utils import multiprocessor_count, nvmma_shared_layout

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
    from triton.language.core import _aggregate as aggregate

    HAVE_GLUON = True
except ImportError:  # older Triton, triton-ascend: the portable kernel serves
    HAVE_GLUON = False

_LOG2E = 1.4426950408889634
BLOCK_M = 128  # query rows a program takes: two warpgroups of 64
ROWS_PER_CONSUMER = 64
_SHARED_BYTES = 224 * 1024  # query tile and K/V stages (H100, H200: 227 KiB a block)

HEAD_SIZES = (64, 128, 256)
# Steps of this many tokens or more take their (query tile, head) pairs from a counter at
# run time, a KV head's query heads at a time; smaller ones keep a fixed stride, every
# head of a query tile in turn (the counter's zeroing and atomics cost them more than
# the balance gains; benchmarks/README.md).
DYNAMIC_MIN_TOKENS = 4096
# (query/key width, value width) pairs besides equal ``HEAD_SIZES``: MLA's prefill.
MIXED_HEAD_SIZES = ((192, 128),)


def hopper_prefill_supported(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor
) -> bool:
    """Whether :func:`hopper_prefill` takes ``query`` ``[tokens, heads, head_size]``,
    ``key`` ``[tokens, kv_heads, head_size]``, ``value`` ``[tokens, kv_heads,
    value_size]`` and ``out`` ``[tokens, heads, value_size]``: Gluon present, CUDA
    tensors, fp16/bf16, equal sizes of ``HEAD_SIZES`` or a pair of
    ``MIXED_HEAD_SIZES``, and each token's heads contiguous in rows a TMA descriptor
    takes (16-byte aligned). The caller checks the device's compute capability (9.x)."""
    if not HAVE_GLUON or query.device.type != "cuda":
        return False
    head_size, value_size = query.shape[-1], value.shape[-1]
    sizes_taken = head_size == value_size and head_size in HEAD_SIZES
    if not (sizes_taken or (head_size, value_size) in MIXED_HEAD_SIZES):
        return False
    if query.dtype not in (torch.float16, torch.bfloat16):
        return False
    if out.dtype != query.dtype or out.stride(-1) != 1 or out.shape[-1] != value_size:
        return False
    return all(
        _rows_take_descriptor(t, query.dtype, width)
        for t, width in ((query, head_size), (key, head_size), (value, value_size))
    )


def _rows_take_descriptor(t: torch.Tensor, dtype: torch.dtype, head_size: int) -> bool:
    return (
        t.dtype == dtype
        and t.dim() == 3
        and t.shape[-1] == head_size
        and t.stride(2) == 1
        and t.stride(1) == head_size
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def hopper_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    lse: torch.Tensor | None = None,
    stages: int = 2,
) -> None:
    """Attention of each request's queries over its own keys, written into ``out``.

    Args:
        query: ``[tokens, heads, head_size]`` fp16/bf16; request ``r`` holds rows
            ``cu_seqlens_q[r]:cu_seqlens_q[r + 1]``.
        key, value: ``[tokens, kv_heads, head_size]`` and ``[tokens, kv_heads,
            value_size]``, the same rows as ``query``.
        out: ``[tokens, heads, value_size]`` (any strides, last one 1).
        cu_seqlens_q: int32 ``[num_reqs + 1]`` on the device.
        lse: optional float32 ``[>= tokens, heads]``: natural-log log-sum-exp of each
            row's scaled scores.
        stages: K/V tiles in flight, at most :func:`max_stages` (3 at head size 128,
            2 at 192 / 128 and 256).

    The caller checks :func:`hopper_prefill_supported`. Rows past
    ``cu_seqlens_q[-1]`` are left untouched.
    """
    num_tokens, num_heads, head_size = query.shape
    num_reqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_reqs == 0:
        return
    num_kv_heads = key.shape[1]
    block_n = key_tile(head_size)
    stages = max(1, min(stages, max_stages(head_size, value.shape[-1], block_n)))
    dtype = gl.float16 if query.dtype == torch.float16 else gl.bfloat16
    # A width that is no power of two (192) is read as a power of two and a tail (128 + 64).
    main = 1 << (head_size.bit_length() - 1)
    tail = head_size - main
    q_desc = _row_descriptor(query, ROWS_PER_CONSUMER, main, dtype)
    k_desc = _row_descriptor(key, block_n, main, dtype)
    v_desc = _row_descriptor(value, block_n, value.shape[-1], dtype)
    # Without a tail these are the main descriptors again, never read.
    qt_desc = _row_descriptor(query, ROWS_PER_CONSUMER, tail, dtype) if tail else q_desc
    kt_desc = _row_descriptor(key, block_n, tail, dtype) if tail else k_desc
    write_lse = lse is not None
    lse_arg, lse_strides = (lse, tuple(lse.stride())) if write_lse else (out, (0, 0))
    value_size = value.shape[-1]
    out_cols = output_tile_cols(head_size, value_size, block_n, stages)
    tma_out = out_cols > 0 and _rows_take_descriptor(out, query.dtype, value_size)
    # Without the output tile this is the value descriptor again, never read.
    o_desc = _row_descriptor(out, ROWS_PER_CONSUMER, out_cols, dtype) if tma_out else v_desc
    num_slots = num_tokens // BLOCK_M + num_reqs
    num_pairs = num_slots * num_heads
    grid = (min(num_pairs, multiprocessor_count(query.device)),)
    dynamic = num_tokens >= DYNAMIC_MIN_TOKENS
    # The pair counter, zeroed for each launch (a static order never reads it).
    counter = torch.zeros(1, dtype=torch.int32, device=query.device) if dynamic else cu_seqlens_q
    _hopper_prefill_kernel[grid](
        counter,
        q_desc,
        k_desc,
        v_desc,
        qt_desc,
        kt_desc,
        o_desc,
        out,
        lse_arg,
        cu_seqlens_q,
        num_reqs,
        num_slots,
        num_pairs,
        out.stride(0),
        out.stride(1),
        *lse_strides,
        scale * _LOG2E,
        QUERIES_PER_KV=num_heads // num_kv_heads,
        TAIL=tail,
        STAGES=stages,
        CAUSAL=causal,
        WRITE_LSE=write_lse,
        TMA_OUT=tma_out,
        DYNAMIC=dynamic,
        num_warps=4,
        maxnreg=168,
    )


def key_tile(head_size: int) -> int:
    """Keys per tile: 128, or 64 at head size 256 (two stages of K and V then fit the
    shared memory beside the query tile; at 192 / 128 two stages of 128 keys do)."""
    return 128 if head_size <= 192 else 64


def max_stages(head_size: int, value_size: int, block_n: int) -> int:
    """K/V stages of ``block_n`` keys that fit beside the query tile (128 rows) in
    ``_SHARED_BYTES`` (16-bit values)."""
    query_bytes = BLOCK_M * head_size * 2
    return (_SHARED_BYTES - query_bytes) // (block_n * (head_size + value_size) * 2)


def output_tile_cols(head_size: int, value_size: int, block_n: int, stages: int) -> int:
    """Columns of the two consumers' output tiles (64 rows each, 16-bit) that fit in
    ``_SHARED_BYTES`` beside the query tile and ``stages`` K/V stages: ``value_size``
    (head sizes 64 and 128 at 2 stages), half of it (192 / 128 and 256 at 2 stages: a
    consumer's rows then go through the tile in two halves of columns), or 0 (none fits:
    128 at 3 stages; the rows are stored from registers)."""
    query_bytes = BLOCK_M * head_size * 2
    stage_bytes = block_n * (head_size + value_size) * 2
    for cols in (value_size, value_size // 2):
        if query_bytes + stages * stage_bytes + BLOCK_M * cols * 2 <= _SHARED_BYTES:
            return cols
    return 0


def _row_descriptor(t: torch.Tensor, rows: int, cols: int, dtype) -> "TensorDescriptor":
    """A 2-D descriptor over ``t`` seen as ``[tokens, heads * head_size]``; a box is
    ``rows`` tokens of ``cols`` columns of one head."""
    tokens, heads, head_size = t.shape
    layout = nvmma_shared_layout(rows, cols, dtype)
    return TensorDescriptor(t, [tokens, heads * head_size], [t.stride(0), 1], [rows, cols], layout)


if HAVE_GLUON:

    @aggregate
    class _Flags:
        """Compile-time switches; a partition's plain arguments arrive as run-time values."""

        causal: gl.constexpr
        write_lse: gl.constexpr
        queries_per_kv: gl.constexpr
        tail: gl.constexpr  # query/key columns past the first power of two (0, or 64 at 192)
        tma_out: gl.constexpr  # full output tiles go through shared memory and TMA stores
        dynamic: gl.constexpr  # pairs handed out at run time (else a fixed stride)

        @gluon.constexpr_function
        def __init__(self, causal, write_lse, queries_per_kv, tail, tma_out, dynamic):
            self.dynamic = gl.constexpr(dynamic)
            self.causal = gl.constexpr(causal)
            self.write_lse = gl.constexpr(write_lse)
            self.queries_per_kv = gl.constexpr(queries_per_kv)
            self.tail = gl.constexpr(tail)
            self.tma_out = gl.constexpr(tma_out)

    @gluon.jit
    def _find_request(cu_seqlens_q_ptr, num_reqs, tile_slot, BLOCK_Q: gl.constexpr):
        """Largest request ``r`` with ``cu_seqlens_q[r] // BLOCK_Q + r <= tile_slot``."""
        lo = num_reqs * 0
        hi = num_reqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            start = gl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
            if start <= tile_slot:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @gluon.jit
    def _work(
        pair, cu_seqlens_q_ptr, num_reqs, num_slots, num_heads,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, G: gl.constexpr,
    ):  # fmt: skip
        """Where (query tile, head) pair ``pair`` lies: whether the tile holds rows of
        its request, the request's first token and length, the tile within the request
        (in blocks of ``BLOCK_M``), the head, the key tiles to visit and how many of
        them, leading, need no mask. Last tiles of a request see the most keys: they
        come first, every head of a tile in turn (``G`` 0), or every head of a group
        of ``G`` in turn, one group's tiles after the other's."""
        if G == 0:
            tile_slot = num_slots - 1 - pair // num_heads
            head = pair % num_heads
        else:
            group = pair // (num_slots * G)
            rem = pair - group * (num_slots * G)
            tile_slot = num_slots - 1 - rem // G
            head = group * G + rem % G
        req = _find_request(cu_seqlens_q_ptr, num_reqs, tile_slot, BLOCK_M)
        q_start = gl.load(cu_seqlens_q_ptr + req)
        q_len = gl.load(cu_seqlens_q_ptr + req + 1) - q_start
        q_tile = tile_slot - (q_start // BLOCK_M + req)
        kv_hi = q_len
        num_full = q_len // BLOCK_N
        if CAUSAL:
            kv_hi = gl.minimum(q_len, (q_tile + 1) * BLOCK_M)
            num_full = (q_tile * BLOCK_M) // BLOCK_N
        num_tiles = gl.cdiv(kv_hi, BLOCK_N)
        valid = q_tile * BLOCK_M < q_len
        return valid, q_start, q_len, q_tile, head, num_tiles, num_full

    @gluon.jit
    def _load_partition(
        q_desc, k_desc, v_desc, qt_desc, kt_desc, q_smem, k_smem, v_smem, qt_smem, kt_smem,
        bars, cu_seqlens_q_ptr, num_reqs, num_slots, num_heads, num_pairs, flags,
        hand, counter_ptr,
    ):  # fmt: skip
        """One warp: for each pair, both query halves, then K and V tiles into the
        stage ring (a running count of tiles sets each stage's phase). With a tail,
        each query half and key tile is two copies on one barrier. With
        ``flags.dynamic`` the pairs come from ``counter_ptr`` and go on to the
        consumers (``_publish``); else this program takes every ``num_programs``-th."""
        loads = (q_desc, k_desc, v_desc, qt_desc, kt_desc, q_smem, k_smem, v_smem, qt_smem, kt_smem)
        work = (cu_seqlens_q_ptr, num_reqs, num_slots, num_heads)
        count = 0
        done = 0
        if flags.dynamic:
            it = 0
            pair = gl.atomic_add(counter_ptr, 1)
            _publish(hand, it, pair)
            while pair < num_pairs:
                count, done = _load_pair(
                    pair, count, done, loads, bars, work, flags, flags.queries_per_kv
                )
                it += 1
                pair = gl.atomic_add(counter_ptr, 1)
                _publish(hand, it, pair)
        else:
            for pair in range(gl.program_id(0), num_pairs, gl.num_programs(0)):
                count, done = _load_pair(pair, count, done, loads, bars, work, flags, 0)

    @gluon.jit
    def _load_pair(pair, count, done, loads, bars, work, flags, G: gl.constexpr):
        """The loader's part of one pair (``_work`` with group ``G``): its query halves
        and key and value tiles; returns the running tile and pair counts."""
        q_desc, k_desc, v_desc, qt_desc, kt_desc, q_smem, k_smem, v_smem, qt_smem, kt_smem = loads
        cu_seqlens_q_ptr, num_reqs, num_slots, num_heads = work
        q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = bars
        rows: gl.constexpr = q_desc.block_type.shape[0]
        MAIN: gl.constexpr = q_desc.block_type.shape[1]
        TAIL: gl.constexpr = flags.tail
        HEAD: gl.constexpr = MAIN + TAIL
        HEAD_V: gl.constexpr = v_desc.block_type.shape[1]
        block_n: gl.constexpr = k_desc.block_type.shape[0]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        QUERIES_PER_KV: gl.constexpr = flags.queries_per_kv
        q_bytes: gl.constexpr = q_desc.block_type.nbytes * HEAD // MAIN  # main and tail
        k_bytes: gl.constexpr = k_desc.block_type.nbytes * HEAD // MAIN
        valid, q_start, _, q_tile, head, num_tiles, _ = _work(
            pair, cu_seqlens_q_ptr, num_reqs, num_slots, num_heads,
            2 * rows, block_n, flags.causal, G,
        )  # fmt: skip
        if valid:
            kv_col = (head // QUERIES_PER_KV) * HEAD
            v_col = (head // QUERIES_PER_KV) * HEAD_V
            for half in gl.static_range(2):
                q_row = q_start + q_tile * 2 * rows + half * rows
                mbarrier.wait(q_empty.index(half), (done & 1) ^ 1)
                mbarrier.expect(q_ready.index(half), q_bytes)
                tma.async_copy_global_to_shared(
                    q_desc, [q_row, head * HEAD], q_ready.index(half), q_smem.index(half)
                )
                if TAIL:
                    tma.async_copy_global_to_shared(
                        qt_desc,
                        [q_row, head * HEAD + MAIN],
                        q_ready.index(half),
                        qt_smem.index(half),
                    )
            for j in range(num_tiles):
                stage = count % STAGES
                empty_phase = ((count // STAGES) & 1) ^ 1  # a fresh barrier counts as emptied
                row = q_start + j * block_n
                mbarrier.wait(k_empty.index(stage), empty_phase)
                mbarrier.expect(k_ready.index(stage), k_bytes)
                tma.async_copy_global_to_shared(
                    k_desc, [row, kv_col], k_ready.index(stage), k_smem.index(stage)
                )
                if TAIL:
                    tma.async_copy_global_to_shared(
                        kt_desc,
                        [row, kv_col + MAIN],
                        k_ready.index(stage),
                        kt_smem.index(stage),
                    )
                mbarrier.wait(v_empty.index(stage), empty_phase)
                mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    v_desc, [row, v_col], v_ready.index(stage), v_smem.index(stage)
                )
                count += 1
            done += 1
        return count, done

    @gluon.jit
    def _publish(hand, it, pair):
        """The loader: pair ``pair`` into hand-off slot ``it % 2`` once both consumers
        took the pair before it there."""
        pair_smem, pair_ready, pair_empty = hand
        slot = it % 2
        mbarrier.wait(pair_empty.index(slot), ((it // 2) & 1) ^ 1)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        pair_smem.index(slot).store(gl.full([1], pair, gl.int32, layout=one))
        mbarrier.arrive(pair_ready.index(slot), count=1)

    @gluon.jit
    def _take(hand, it):
        """A consumer: the pair in hand-off slot ``it % 2``; frees the slot."""
        pair_smem, pair_ready, pair_empty = hand
        slot = it % 2
        mbarrier.wait(pair_ready.index(slot), (it // 2) & 1)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        pair = gl.max(pair_smem.index(slot).load(one), axis=0)
        gl.thread_barrier()
        mbarrier.arrive(pair_empty.index(slot), count=1)
        return pair

    @gluon.jit
    def _masked_scores(
        s, row_pos, key0, q_len,
        BLOCK_N: gl.constexpr, s_layout: gl.constexpr, CAUSAL: gl.constexpr,
    ):  # fmt: skip
        key_pos = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL:
            visible = (key_pos[None, :] <= row_pos[:, None]) & (key_pos < q_len)[None, :]
        else:
            visible = (row_pos >= 0)[:, None] & (key_pos < q_len)[None, :]
        return gl.where(visible, s, float("-inf"))

    @gluon.jit
    def _consumer_partition(
        q_smem, k_smem, v_smem, qt_smem, kt_smem, o_desc, o_smem, bars, out_ptr, lse_ptr,
        cu_seqlens_q_ptr, num_reqs, num_slots, num_heads, num_pairs,
        stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, flags, half, hand,
    ):  # fmt: skip
        """One warpgroup: 64 query rows of each pair against its key tiles (the pairs
        the loader takes, in its order)."""
        smem = (q_smem, k_smem, v_smem, qt_smem, kt_smem, o_desc, o_smem)
        work = (cu_seqlens_q_ptr, num_reqs, num_slots, num_heads)
        outs = (out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh, qk_scale)
        count = 0
        done = 0
        if flags.dynamic:
            it = 0
            pair = _take(hand, it)
            while pair < num_pairs:
                count, done = _consume_pair(
                    pair, count, done, smem, bars, work, outs, flags, half, flags.queries_per_kv
                )
                it += 1
                pair = _take(hand, it)
        else:
            for pair in range(gl.program_id(0), num_pairs, gl.num_programs(0)):
                count, done = _consume_pair(
                    pair, count, done, smem, bars, work, outs, flags, half, 0
                )
        if flags.tma_out:  # the last tile's store reads the shared memory until it is done
            tma.store_wait(0)

    @gluon.jit
    def _consume_pair(
        pair, count, done, smem, bars, work, outs, flags, half, G: gl.constexpr
    ):  # fmt: skip
        """A consumer's part of one pair (``_work`` with group ``G``); returns the
        running tile and pair counts."""
        q_smem, k_smem, v_smem, qt_smem, kt_smem, o_desc, o_smem = smem
        cu_seqlens_q_ptr, num_reqs, num_slots, num_heads = work
        out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh, qk_scale = outs
        q_ready = bars[0]
        rows: gl.constexpr = q_smem.type.shape[1]
        block_n: gl.constexpr = k_smem.type.shape[1]
        valid, q_start, q_len, q_tile, head, num_tiles, num_full = _work(
            pair, cu_seqlens_q_ptr, num_reqs, num_slots, num_heads,
            2 * rows, block_n, flags.causal, G,
        )  # fmt: skip
        if valid:
            mbarrier.wait(q_ready.index(half), done & 1)
            o, m_i, l_i, first_row = _attend_tile(
                q_smem, k_smem, v_smem, qt_smem, kt_smem, bars, half, count, q_tile,
                q_len, num_tiles, num_full, qk_scale, flags.causal, flags.tail,
            )  # fmt: skip
            _store_rows(
                o, m_i, l_i, out_ptr, lse_ptr, o_desc, o_smem.index(half), q_start,
                first_row, q_len, head, stride_ot, stride_oh, stride_lt, stride_lh,
                flags.write_lse, flags.tma_out,
            )  # fmt: skip
            count += num_tiles
            done += 1
        return count, done

    @gluon.jit
    def _scores(q, k, qt, kt, zero_s, TAIL: gl.constexpr):
        """Issue ``Q @ K^T`` of a key tile (asynchronous): the main columns, then the
        tail's (one accumulator, so one wait covers both)."""
        s = warpgroup_mma(q, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if TAIL:
            s = warpgroup_mma(qt, kt.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _attend_tile(
        q_smem, k_smem, v_smem, qt_smem, kt_smem, bars, half, count, q_tile, q_len,
        num_tiles, num_full, qk_scale, CAUSAL: gl.constexpr, TAIL: gl.constexpr,
    ):  # fmt: skip
        """The softmax of key tile ``j`` overlapping the ``P @ V`` of tile ``j - 1``;
        ``count``: key tiles this program consumed before. Releases the query half once
        its last scores are in. Returns the unnormalized output, the running max and
        sum (log2 domain) and the half's first row within its request."""
        _, q_empty, k_ready, v_ready, k_empty, v_empty = bars
        rows: gl.constexpr = q_smem.type.shape[1]
        HEAD_V: gl.constexpr = v_smem.type.shape[2]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        block_n: gl.constexpr = k_smem.type.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_V, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype

        first_row = q_tile * (2 * rows) + half * rows  # within the request
        row_pos = first_row + gl.arange(0, rows, layout=gl.SliceLayout(1, s_layout))
        q = q_smem.index(half)
        qt = qt_smem.index(half)
        zero_s = gl.zeros([rows, block_n], gl.float32, layout=s_layout)

        # Tile 0: its scores alone.
        stage = count % STAGES
        mbarrier.wait(k_ready.index(stage), (count // STAGES) & 1)
        s = _scores(q, k_smem.index(stage), qt, kt_smem.index(stage), zero_s, TAIL)
        s = warpgroup_mma_wait(0, deps=(s, q, k_smem.index(stage), qt, kt_smem.index(stage)))[0]
        mbarrier.arrive(k_empty.index(stage), count=1)
        if num_full == 0:
            s = _masked_scores(s, row_pos, 0, q_len, block_n, s_layout, CAUSAL)
        m_i = gl.max(s, axis=1) * qk_scale
        p = gl.exp2(s * qk_scale - m_i[:, None])
        l_i = gl.sum(p, axis=1)
        o = gl.zeros([rows, HEAD_V], gl.float32, layout=o_layout)

        for j in range(1, num_tiles):
            stage = (count + j) % STAGES
            prev = (count + j - 1) % STAGES
            mbarrier.wait(k_ready.index(stage), ((count + j) // STAGES) & 1)
            s_tok = _scores(q, k_smem.index(stage), qt, kt_smem.index(stage), zero_s, TAIL)
            mbarrier.wait(v_ready.index(prev), ((count + j - 1) // STAGES) & 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            o_tok = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok, k_smem.index(stage), kt_smem.index(stage)))[0]
            mbarrier.arrive(k_empty.index(stage), count=1)
            if j >= num_full:
                s = _masked_scores(s, row_pos, j * block_n, q_len, block_n, s_layout, CAUSAL)
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s * qk_scale - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            o = warpgroup_mma_wait(0, deps=(o_tok, v_smem.index(prev), p_op))[0]
            mbarrier.arrive(v_empty.index(prev), count=1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.arrive(q_empty.index(half), count=1)

        last = (count + num_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((count + num_tiles - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o = warpgroup_mma(p_op, v_smem.index(last), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o, v_smem.index(last), p_op))[0]
        mbarrier.arrive(v_empty.index(last), count=1)
        return o, m_i, l_i, first_row

    @gluon.jit
    def _store_rows(
        o, m_i, l_i, out_ptr, lse_ptr, o_desc, o_smem, q_start, first_row, q_len, head,
        stride_ot, stride_oh, stride_lt, stride_lh, WRITE_LSE: gl.constexpr,
        TMA_OUT: gl.constexpr,
    ):  # fmt: skip
        """Normalize and write a half's rows of ``out`` (and of ``lse``): with
        ``TMA_OUT``, a tile of rows all within the request through ``o_smem`` (whole, or
        in two halves of columns where ``o_smem`` holds half a row) and the last TMA
        store left running (the tile before it finished first); else from registers."""
        o_layout: gl.constexpr = o.type.layout
        rows: gl.constexpr = o.type.shape[0]
        HEAD: gl.constexpr = o.type.shape[1]
        OUT_COLS: gl.constexpr = o_smem.type.shape[1]
        o = o / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        o = o.to(out_ptr.dtype.element_ty)
        if TMA_OUT:
            if first_row + rows <= q_len:
                token = q_start + first_row
                if OUT_COLS == HEAD:
                    _store_tile(o, o_desc, o_smem, token, head * HEAD)
                else:
                    # Column c of o is 2 * (c % OUT_COLS) + c // OUT_COLS of the permuted
                    # view: a split in registers (the halves' columns are register bits).
                    halves = gl.permute(gl.reshape(o, [rows, 2, OUT_COLS]), (0, 2, 1))
                    o_lo, o_hi = gl.split(halves)
                    _store_tile(o_lo, o_desc, o_smem, token, head * HEAD)
                    _store_tile(o_hi, o_desc, o_smem, token, head * HEAD + OUT_COLS)
            else:
                _store_masked(o, out_ptr, q_start, first_row, q_len, head, stride_ot, stride_oh)
        else:
            _store_masked(o, out_ptr, q_start, first_row, q_len, head, stride_ot, stride_oh)
        if WRITE_LSE:
            row_pos = first_row + gl.arange(0, rows, layout=m_i.type.layout)
            lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
            lse_token = (q_start + row_pos).to(gl.int64)
            gl.store(lse_ptr + lse_token * stride_lt + head * stride_lh, lse, mask=row_pos < q_len)

    @gluon.jit
    def _store_tile(o, o_desc, o_smem, token, col):
        """``o`` into ``o_smem`` once the store before has read it, then its TMA store to
        rows from ``token``, columns from ``col`` (left running)."""
        tma.store_wait(0)
        o_smem.store(o)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [token, col], o_smem)

    @gluon.jit
    def _store_masked(o, out_ptr, q_start, first_row, q_len, head, stride_ot, stride_oh):
        """Rows of ``o`` within the request (``first_row + r < q_len``) from registers."""
        o_layout: gl.constexpr = o.type.layout
        rows: gl.constexpr = o.type.shape[0]
        HEAD: gl.constexpr = o.type.shape[1]
        out_rows = first_row + gl.arange(0, rows, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_layout))
        token = (q_start + out_rows).to(gl.int64)
        dst = out_ptr + token[:, None] * stride_ot + head * stride_oh + cols[None, :]
        gl.store(dst, o, mask=(out_rows < q_len)[:, None])

    @gluon.jit
    def _hopper_prefill_kernel(
        counter_ptr, q_desc, k_desc, v_desc, qt_desc, kt_desc, o_desc, out_ptr, lse_ptr, cu_seqlens_q_ptr,
        num_reqs, num_slots, num_pairs, stride_ot, stride_oh, stride_lt, stride_lh, qk_scale,
        QUERIES_PER_KV: gl.constexpr, TAIL: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, TMA_OUT: gl.constexpr,
        DYNAMIC: gl.constexpr,
    ):  # fmt: skip
        rows: gl.constexpr = q_desc.block_type.shape[0]
        MAIN: gl.constexpr = q_desc.block_type.shape[1]
        HEAD_V: gl.constexpr = v_desc.block_type.shape[1]
        block_n: gl.constexpr = k_desc.block_type.shape[0]
        num_heads = num_pairs // num_slots
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, rows, MAIN], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, block_n, MAIN], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, block_n, HEAD_V], v_desc.layout)
        if TAIL:
            qt_smem = gl.allocate_shared_memory(dtype, [2, rows, TAIL], qt_desc.layout)
            kt_smem = gl.allocate_shared_memory(dtype, [STAGES, block_n, TAIL], kt_desc.layout)
        else:  # never read
            qt_smem = q_smem
            kt_smem = k_smem
        if TMA_OUT:
            OUT_COLS: gl.constexpr = o_desc.block_type.shape[1]
            o_smem = gl.allocate_shared_memory(dtype, [2, rows, OUT_COLS], o_desc.layout)
        else:  # never read
            o_smem = q_smem
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer
            mbarrier.init(v_empty.index(i), count=2)
        if DYNAMIC:  # the loader hands each pair to the consumers: two slots
            pair_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            pair_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            pair_smem = gl.allocate_shared_memory(
                gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            )
            for i in gl.static_range(2):
                mbarrier.init(pair_ready.index(i), count=1)
                mbarrier.init(pair_empty.index(i), count=2)  # one arrival per consumer
            hand = (pair_smem, pair_ready, pair_empty)
        else:  # never read
            hand = (q_ready, q_ready, q_ready)
        bars = (q_ready, q_empty, k_ready, v_ready, k_empty, v_empty)
        flags = _Flags(CAUSAL, WRITE_LSE, QUERIES_PER_KV, TAIL, TMA_OUT, DYNAMIC)
        first_consumer_args = (
            q_smem, k_smem, v_smem, qt_smem, kt_smem, o_desc, o_smem, bars, out_ptr, lse_ptr,
            cu_seqlens_q_ptr, num_reqs, num_slots, num_heads, num_pairs,
            stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, flags, 0, hand,
        )  # fmt: skip
        second_consumer_args = (
            q_smem, k_smem, v_smem, qt_smem, kt_smem, o_desc, o_smem, bars, out_ptr, lse_ptr,
            cu_seqlens_q_ptr, num_reqs, num_slots, num_heads, num_pairs,
            stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, flags, 1, hand,
        )  # fmt: skip
        load_args = (
            q_desc, k_desc, v_desc, qt_desc, kt_desc, q_smem, k_smem, v_smem, qt_smem, kt_smem,
            bars, cu_seqlens_q_ptr, num_reqs, num_slots, num_heads, num_pairs, flags,
            hand, counter_ptr,
        )  # fmt: skip
        gl.warp_specialize(
            [
                (_consumer_partition, first_consumer_args),
                (_consumer_partition, second_consumer_args),
                (_load_partition, load_args),
            ],
            [4, 1],
            [240, 24],  # at 40 for the loader, ptxas spilled the consumers' registers
        )
