"""Context parallelism: attention over a KV cache sharded across ranks.

Decode context parallel (DCP, vLLM's ``decode_context_parallel_size`` N with
``cp_kv_cache_interleave_size`` I): the tokens of every request are dealt to the
ranks in runs of I, round robin; rank ``r`` keeps the tokens at positions ``p``
with ``(p // I) % N == r``, in order. On a rank, the same block table as
everywhere (vLLM allocates blocks for the whole group) addresses that rank's
share: page ``k`` of a request holds the rank's tokens among positions
``[k * B * N, (k + 1) * B * N)`` (B the block size), so the rank's ``j``-th token
(local position ``j``) sits at slot ``block_table[j // B] * B + j % B`` when I
divides B. A token kept by another rank has slot ``-1`` in this rank's slot mapping.

A step's attention under DCP, as vLLM 0.32 computes it (the FlashAttention backend's
``_forward_with_dcp``): every rank attends the query, all heads, over its own share
of the *context* (the tokens cached before this step) without a causal mask
(``plan_context``, ``run(..., lse=...)``), the ranks' partial outputs are merged by
their log-sum-exp (``merge_attention_states``), and the result is merged with
causal attention of the step's new tokens over themselves (``plan`` without a
cache). ``tests/test_context_parallel.py`` shows that this equals unsharded
attention in every batch state.

Prefill context parallel (PCP, ``prefill_context_parallel_size`` P): the query
tokens of each prefill are cut into 2P chunks and rank ``r`` computes chunks ``r``
and ``2P - 1 - r`` (``pcp_query_chunks``), over the whole KV (which vLLM gathers
to every rank); ``pcp_local_batch`` gives the rank's batch for ``plan``, and
``pcp_write_plan`` the plan that writes the rows gathered from every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from npu_attention import _inputs
from npu_attention._inputs import HostArrays
from npu_attention.buffers import PlanBuffers
from npu_attention.mla.spec import MLASpec
from npu_attention.plan import AttentionPlan, SlotHandling, build_plan
from npu_attention.spec import AttentionSpec

# ------------------------------------------------------------------ DCP sharding


def dcp_local_seq_lens(
    seq_lens: Any, dcp_size: int, interleave_size: int = 1, rank: int | None = None
) -> np.ndarray:
    """How many of each request's first ``seq_lens[i]`` tokens each DCP rank keeps.

    Rank ``r`` keeps positions ``p`` with ``(p // interleave_size) % dcp_size == r``
    (vLLM 0.32's ``get_dcp_local_seq_lens`` rule). Padded requests (length 0) get 0.

    Args:
        seq_lens: host ``[num_reqs]`` non-negative ints.
        dcp_size: N >= 1 ranks.
        interleave_size: I >= 1 consecutive tokens per rank in turn.
        rank: one rank, or ``None`` for all.

    Returns:
        int64 ``[num_reqs]`` for ``rank``, or ``[num_reqs, dcp_size]`` for all ranks.
    """
    _check_sizes(dcp_size, interleave_size)
    lengths = _inputs.as_host_array(seq_lens, "seq_lens")
    if lengths.min(initial=0) < 0:
        raise ValueError(f"seq_lens must be non-negative, got {lengths.tolist()}")
    ranks = np.arange(dcp_size) if rank is None else np.asarray(_check_rank(rank, dcp_size))
    per_round = dcp_size * interleave_size
    full = lengths // per_round * interleave_size  # tokens of the complete rounds
    rest = lengths % per_round  # the last, partial round
    if rank is None:
        full, rest = full[:, None], rest[:, None]
    return full + np.clip(rest - ranks * interleave_size, 0, interleave_size)


def dcp_owner(positions: Any, dcp_size: int, interleave_size: int = 1) -> np.ndarray:
    """The DCP rank that keeps each token position: ``(p // I) % N``.

    Not used by the vLLM bridge today (vLLM computes each rank's slot mapping); for
    engines that shard the KV cache themselves, and for tests."""
    _check_sizes(dcp_size, interleave_size)
    pos = _inputs.as_host_array(positions, "positions")
    return pos // interleave_size % dcp_size


def dcp_local_positions(positions: Any, dcp_size: int, interleave_size: int = 1) -> np.ndarray:
    """Each token position's index among its owner's tokens of the same request:
    ``(p // (N * I)) * I + p % I``. Not used by the vLLM bridge today (see ``dcp_owner``)."""
    _check_sizes(dcp_size, interleave_size)
    pos = _inputs.as_host_array(positions, "positions")
    return pos // (dcp_size * interleave_size) * interleave_size + pos % interleave_size


def dcp_slot_mapping(
    positions: Any,
    request_of_token: Any,
    block_tables: Any,
    block_size: int,
    dcp_size: int,
    rank: int,
    interleave_size: int = 1,
) -> np.ndarray:
    """Rank ``rank``'s slot of each token (``-1`` where another rank keeps it).

    A token at position ``p`` of request ``i`` kept by ``rank`` goes to
    ``block_tables[i, p // (B * N)] * B + local % B`` with ``local`` its
    ``dcp_local_positions`` index (vLLM 0.32's slot mapping under DCP: a request's
    block-table entry ``k`` covers the ``B * N`` positions of "virtual block" ``k``).
    Not used by the vLLM bridge today (see ``dcp_owner``).

    Args:
        positions, request_of_token: host ``[num_tokens]`` ints.
        block_tables: host ``[num_reqs, max_blocks]`` ints, the same on every rank.
        block_size: B; a multiple of ``interleave_size``.

    Returns:
        int64 ``[num_tokens]``.
    """
    _check_sizes(dcp_size, interleave_size)
    _check_rank(rank, dcp_size)
    if block_size % interleave_size:
        raise ValueError(
            f"block_size must be a multiple of interleave_size, got block_size={block_size}, "
            f"interleave_size={interleave_size}"
        )
    pos = _inputs.as_host_array(positions, "positions")
    reqs = _inputs.as_host_array(request_of_token, "request_of_token")
    tables = np.asarray(block_tables, dtype=np.int64)
    local = dcp_local_positions(pos, dcp_size, interleave_size)
    blocks = tables[reqs, pos // (block_size * dcp_size)]
    slots = blocks * block_size + local % block_size
    return np.where(dcp_owner(pos, dcp_size, interleave_size) == rank, slots, -1)


def plan_context(
    cu_seqlens_q: Any,
    context_lens: Any,
    block_tables: Any,
    num_decodes: int,
    spec: AttentionSpec | MLASpec,
    *,
    device: torch.device | str | None = None,
    provider: str | None = None,
    buffers: PlanBuffers | None = None,
    num_blocks: int | None = None,
    slot_mapping: Any = None,
    slot_handling: str = "host",
    null_block: int | None = None,
) -> AttentionPlan:
    """A plan in which each request's query rows attend to its first ``context_lens[i]``
    cached keys only (none of the step's own), all of them visible to every row.

    This is the context half of DCP attention: ``context_lens`` are the rank's
    local context lengths (``dcp_local_seq_lens`` of ``seq_lens - query_lens``) and
    may be smaller than a request's query length, or 0 (then its rows get LSE
    ``-inf`` and zeros). ``run(query, None, None, key_cache, value_cache, plan, out,
    lse=lse)`` writes nothing to the cache. With ``slot_mapping`` (the rank's slots of
    the step's tokens, ``-1`` for tokens another rank keeps, as ``dcp_slot_mapping``
    gives them), ``run(query, key, value, ...)`` writes the rank's share of the new
    K/V before it attends; the writes land past every ``context_lens[i]``, so the
    attention does not see them. The plan's ``seq_lens`` (and, on Ascend,
    ``actual_seq_lengths_kv``) are ``context_lens``; in fixed-buffer mode they are the
    step argument a graph replay reads.

    ``slot_handling`` and ``null_block`` are ``plan``'s.

    ``spec`` is the layer's spec; its causal mask does not apply (every context
    key precedes every query). A sliding window needs global positions that a
    rank's share does not keep, and is refused. With an ``MLASpec`` the plan is one
    of decodes only (``num_decodes`` must be every request, each of one query token:
    the bridge makes a request of each token under DCP); ``mla_decode(..., lse=)``
    then attends each row over its request's ``context_lens[i]`` latents.

    Raises:
        ValueError / TypeError: as ``plan``, for a ``sliding_window``, and for an
            ``MLASpec`` plan with a request of more than one query token or prefills.
    """
    cu = _inputs.as_host_array(cu_seqlens_q, "cu_seqlens_q")
    ctx = _inputs.as_host_array(context_lens, "context_lens")
    query_lens = _inputs.check_cu_seqlens(cu, ctx)
    if ctx.min(initial=0) < 0:
        raise ValueError(f"context_lens must be non-negative, got {ctx.tolist()}")
    spec = _context_spec(spec, query_lens, num_decodes)
    host = HostArrays(cu, query_lens, ctx, ctx)
    if slot_mapping is None:
        slot_mapping = torch.full((int(cu[-1]),), -1, dtype=torch.int64)
    return build_plan(
        host,
        block_tables,
        slot_mapping,
        num_decodes,
        spec,
        device,
        provider,
        buffers,
        num_blocks,
        slot_handling=SlotHandling(slot_handling, null_block, num_blocks),
    )


def _context_spec(spec: Any, query_lens: np.ndarray, num_decodes: int) -> Any:
    """The spec a context plan runs: non-causal attention, or MLA decodes of one token."""
    if isinstance(spec, MLASpec):
        if num_decodes != len(query_lens) or query_lens.max(initial=0) > 1:
            raise ValueError(
                "plan_context with an MLASpec plans decodes of one query token each "
                f"(num_decodes = every request), got num_decodes={num_decodes} of "
                f"{len(query_lens)} requests with query lengths {query_lens.tolist()}"
            )
        return spec
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an AttentionSpec or MLASpec, got {type(spec).__name__}")
    if spec.sliding_window is not None:
        raise ValueError(
            "plan_context does not support sliding_window (a rank's context share has "
            f"no global positions), got sliding_window={spec.sliding_window}"
        )
    return dataclasses.replace(spec, causal=False)


# ------------------------------------------------------------------ merge


def merge_attention_states(
    outputs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over disjoint key sets into attention over their union.

    ``out = sum_r exp(lse_r - lse) * outputs_r`` with ``lse = log(sum_r exp(lse_r))``
    (natural log). A part with LSE ``-inf`` (no key: an empty shard) has weight 0,
    whatever its output row holds; a row whose every part is ``-inf`` gets zeros and
    ``-inf``.

    Args:
        outputs: ``[parts, tokens, heads, head_size]`` (any float dtype).
        lses: float32 ``[parts, tokens, heads]``.
        out: optional ``[tokens, heads, head_size]`` written in place (default: a new
            tensor of ``outputs.dtype``).
        out_lse: optional float32 ``[tokens, heads]`` written in place.

    Returns:
        ``(out, out_lse)``. Computed in float32 with torch ops on the inputs' device.
    """
    if outputs.dim() != 4 or lses.dim() != 3 or tuple(lses.shape) != tuple(outputs.shape[:3]):
        raise ValueError(
            "outputs must be [parts, tokens, heads, head_size] and lses [parts, tokens, heads], "
            f"got {tuple(outputs.shape)} and {tuple(lses.shape)}"
        )
    if lses.dtype != torch.float32:
        raise TypeError(f"lses must be float32, got {lses.dtype}")
    if outputs.shape[0] == 0:
        raise ValueError("merge_attention_states needs at least one part, got 0")
    lse_max = lses.amax(dim=0)
    finite_max = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    weights = torch.exp(lses - finite_max)  # [parts, tokens, heads]; -inf parts -> 0
    total = weights.sum(dim=0)
    merged_lse = torch.where(total > 0, finite_max + torch.log(total), lse_max)
    scale = weights / torch.where(total > 0, total, torch.ones_like(total))
    parts = torch.where(weights[..., None] > 0, outputs.float(), 0.0)  # 0 * NaN is NaN
    merged = (parts * scale[..., None]).sum(dim=0)
    if out is None:
        out = merged.to(outputs.dtype)
    else:
        out.copy_(merged)
    if out_lse is None:
        out_lse = merged_lse
    else:
        out_lse.copy_(merged_lse)
    return out, out_lse


# ------------------------------------------------------------------ PCP


def pcp_write_plan(
    plan: AttentionPlan, slot_mapping: Any, *, num_blocks: int | None = None
) -> AttentionPlan:
    """A plan that writes the cache rows gathered from every PCP rank.

    Under PCP a rank attends only its own chunks' query rows (``plan``), but its
    cache must hold every rank's new keys: vLLM 0.32's MLA layer all-gathers the
    step's latent rows over the PCP group (rank after rank, each padded to the same
    count) and writes them at a gathered slot mapping, ``-1`` for padding and for
    rows another rank writes. The result is ``plan`` with that ``slot_mapping`` and
    ``num_actual_tokens = len(slot_mapping)``, for ``mla_write_cache`` with the
    gathered rows; it is for writing only (attend with ``plan``).

    Args:
        plan: the rank's plan (any spec).
        slot_mapping: int ``[num_gathered_rows]``, host or ``plan.device``.
        num_blocks: the cache's blocks, to check host slots against (optional).

    Raises:
        TypeError / ValueError: a slot mapping that is not 1-D integers, or a host
            slot past ``num_blocks``.
    """
    slots = _inputs.as_int_tensor(slot_mapping, "slot_mapping", ndim=1)
    _inputs.check_slot_mapping(slots, slots.shape[0], plan.spec.block_size, num_blocks)
    written = dataclasses.replace(
        plan,
        num_actual_tokens=int(slots.shape[0]),
        slot_mapping=_inputs.to_device(slots, plan.device, torch.int64),
        provider_data=None,
    )
    written.provider_data = plan.provider.prepare(written)
    return written


# PCPLocalBatch and pcp_query_chunks are not used by the vLLM bridge (vLLM splits the
# batch itself); they are for engines that split prefills over ranks as vLLM 0.32 does.


@dataclass(frozen=True)
class PCPLocalBatch:
    """One PCP rank's share of a step, ready for ``plan`` (decodes first).

    Each local request is one chunk of a global request's query tokens; it attends
    causally to everything before it, so its ``seq_lens`` entry is the chunk's end
    position + 1 and its block-table row is its global request's.
    """

    cu_seqlens_q: np.ndarray  # int64 [num_local + 1]
    seq_lens: np.ndarray  # int64 [num_local]
    request: np.ndarray  # int64 [num_local], global request of each local request
    tokens: np.ndarray  # int64 [num_local_tokens], global token index of each local token
    num_decodes: int


def pcp_query_chunks(
    query_lens: Any, num_decodes: int, pcp_size: int, rank: int, dcp_size: int = 1
) -> list[tuple[int, int, int]]:
    """``(request, query offset, length)`` of the query tokens PCP rank ``rank`` computes.

    vLLM 0.32's split (``PCPManager._iter_rank_chunks``, without sharded decodes):
    a prefill of ``q`` tokens is cut into ``2P`` chunks of ``ceil(q / 2P)`` tokens
    (the last ones shorter or empty) and rank ``r`` takes chunks ``r`` and
    ``2P - 1 - r``; decodes, and with ``dcp_size > 1`` prefills whose last chunk is
    empty (``(2P - 1) * ceil(q / 2P) >= q``), are computed whole on every rank.
    Chunks are listed decodes first, then by request and offset. Not used by the
    vLLM bridge today.
    """
    if pcp_size < 1:
        raise ValueError(f"pcp_size must be >= 1, got {pcp_size}")
    _check_rank(rank, pcp_size)
    lens = _inputs.as_host_array(query_lens, "query_lens")
    num_chunks = 2 * pcp_size
    chunks: list[tuple[bool, int, int, int]] = []
    for req, q in enumerate(lens.tolist()):
        if q == 0:
            continue
        prefill = req >= num_decodes
        size = -(-q // num_chunks)
        replicated = not prefill or (dcp_size > 1 and (num_chunks - 1) * size >= q)
        if replicated:
            chunks.append((prefill, req, 0, q))
            continue
        for index in (rank, num_chunks - 1 - rank):
            length = min(size, q - index * size)
            if length > 0:
                chunks.append((prefill, req, index * size, length))
    chunks.sort()
    return [(req, offset, length) for _, req, offset, length in chunks]


def pcp_local_batch(
    cu_seqlens_q: Any, seq_lens: Any, num_decodes: int, pcp_size: int, rank: int, dcp_size: int = 1
) -> PCPLocalBatch:
    """Rank ``rank``'s local batch under PCP (see ``pcp_query_chunks``): plan it with
    ``plan(batch.cu_seqlens_q, batch.seq_lens, block_tables[batch.request], None,
    batch.num_decodes, spec)`` over the full cache, feed it ``query[batch.tokens]``,
    and put its output rows back at ``batch.tokens``. Not used by the vLLM bridge today."""
    cu = _inputs.as_host_array(cu_seqlens_q, "cu_seqlens_q")
    seq = _inputs.as_host_array(seq_lens, "seq_lens")
    query_lens = _inputs.check_cu_seqlens(cu, seq)
    context = seq - query_lens
    chunks = pcp_query_chunks(query_lens, num_decodes, pcp_size, rank, dcp_size)
    lengths = np.array([n for _, _, n in chunks], dtype=np.int64)
    request = np.array([r for r, _, _ in chunks], dtype=np.int64)
    offsets = np.array([o for _, o, _ in chunks], dtype=np.int64)
    tokens = [np.arange(cu[r] + o, cu[r] + o + n) for r, o, n in chunks]
    return PCPLocalBatch(
        cu_seqlens_q=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        seq_lens=context[request] + offsets + lengths if chunks else np.zeros(0, np.int64),
        request=request,
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int64),
        num_decodes=int(np.count_nonzero(request < num_decodes)),
    )


def _check_sizes(dcp_size: int, interleave_size: int) -> None:
    if dcp_size < 1 or interleave_size < 1:
        raise ValueError(
            f"dcp_size and interleave_size must be >= 1, got {dcp_size} and {interleave_size}"
        )


def _check_rank(rank: int, size: int) -> int:
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    return rank
