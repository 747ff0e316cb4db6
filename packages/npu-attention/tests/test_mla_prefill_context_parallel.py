"""MLA under prefill context parallelism, as vLLM 0.32 runs it: each PCP rank computes
its DualChunkSwap chunks of every prefill (``pcp_local_batch``: each chunk a request
whose sequence ends at the chunk) and every decode, but writes the latent rows of every
rank into its own replica of the cache: the rows gathered rank after rank, each rank's
padded to the same count, at a gathered slot mapping that is ``-1`` for padding and for
rows another rank writes (``pcp_write_plan``).

Each rank's rows, put back at their global tokens, must equal the float64 oracle of the
unsharded batch within ``MLA_TOLERANCE``, and every rank's cache must hold every new
latent at its slot and nothing elsewhere. Provider: ``reference``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mla_cases import (
    MLA_TOLERANCE,
    SMALL_SPEC,
    MLACase,
    MLAPaged,
    assert_latents_written,
    make_mla_case,
    oracle_decode,
    oracle_prefill,
)

from npu_attention import plan
from npu_attention.context_parallel import pcp_local_batch, pcp_write_plan
from npu_attention.mla import MLASpec, mla_decode, mla_prefill, mla_write_cache

# (query_lens, context_lens, num_decodes): a fresh prefill, a prefix-cache hit, a
# chunked prefill behind decodes, and a prefill shorter than its 2P chunks.
BATCHES = {
    "prefill": ([13, 8], [0, 0], 0),
    "prefill_cache_hit": ([9, 16], [21, 3], 0),
    "chunked_prefill": ([1, 1, 11], [30, 4, 7], 2),
    "short_prefill": ([1, 3], [5, 0], 1),
}
SPEC = MLASpec(**SMALL_SPEC, block_size=16, dtype=torch.float32)


def _rank_batches(case: MLACase, pcp_size: int):
    return [
        pcp_local_batch(case.cu_seqlens_q, case.seq_lens, case.num_decodes, pcp_size, rank)
        for rank in range(pcp_size)
    ]


def _gathered_rows(case: MLACase, paged: MLAPaged, batches) -> tuple[torch.Tensor, ...]:
    """Every rank's new latent rows, rank after rank, each padded to the longest; and
    their slots: ``-1`` for padding and for a decode row of any rank but 0 (every rank
    computes the decodes; rank 0's rows are written)."""
    kv_c, k_pe = case.new_latents()
    width = max(len(batch.tokens) for batch in batches)
    rows_c, rows_pe, slots = [], [], []
    for rank, batch in enumerate(batches):
        tokens = torch.from_numpy(batch.tokens)
        pad = width - len(tokens)
        rank_slots = paged.slot_mapping[tokens].clone()
        if rank:
            rank_slots[tokens < case.num_decode_tokens] = -1
        rows_c += [kv_c[tokens], kv_c.new_full((pad, kv_c.shape[1]), 5.0)]
        rows_pe += [k_pe[tokens], k_pe.new_full((pad, k_pe.shape[1]), 5.0)]
        slots += [rank_slots, torch.full((pad,), -1, dtype=torch.int64)]
    return torch.cat(rows_c), torch.cat(rows_pe), torch.cat(slots)


def _rank_rows(case: MLACase, paged: MLAPaged, batch, gathered) -> tuple[torch.Tensor, ...]:
    """One rank: the gathered write into its own replica, then its decode and prefill rows."""
    rank_paged = MLAPaged(
        paged.block_tables,
        paged.slot_mapping,
        type(paged.cache)(paged.cache.kv_c.clone(), paged.cache.k_pe.clone()),
        paged.num_blocks,
    )
    step = plan(
        batch.cu_seqlens_q,
        batch.seq_lens,
        paged.block_tables[batch.request],
        None,
        batch.num_decodes,
        case.spec,
        provider="reference",
        num_blocks=paged.num_blocks,
    )
    kv_c, k_pe, slots = gathered
    write = pcp_write_plan(step, slots, num_blocks=paged.num_blocks)
    assert write.num_actual_tokens == len(slots) and step.num_actual_tokens == len(batch.tokens)
    mla_write_cache(kv_c, k_pe, rank_paged.cache, write)
    tokens = torch.from_numpy(batch.tokens)
    nd = step.num_decode_tokens
    decode_tokens, prefill_rows = tokens[:nd], tokens[nd:] - case.num_decode_tokens
    decode_out = case.q_latent.new_full((nd, case.spec.num_heads, case.spec.kv_lora_rank), -3.0)
    mla_decode(
        case.q_latent[decode_tokens], case.q_rope[decode_tokens], rank_paged.cache, step, decode_out
    )
    prefill_out = case.query.new_full(
        (len(prefill_rows), case.spec.num_heads, case.spec.v_head_dim), -3.0
    )
    mla_prefill(case.query[prefill_rows], rank_paged.cache, step, case.kv_up_proj, prefill_out)
    return rank_paged, decode_tokens, decode_out, prefill_rows, prefill_out


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("pcp_size", [2, 3])
def test_pcp_ranks_write_gathered_latents_and_equal_unsharded_mla(name: str, pcp_size: int) -> None:
    query_lens, context_lens, num_decodes = BATCHES[name]
    case = make_mla_case(SPEC, query_lens, context_lens, num_decodes, seed=pcp_size)
    paged = case.paged(np.random.default_rng(pcp_size))
    batches = _rank_batches(case, pcp_size)
    gathered = _gathered_rows(case, paged, batches)
    nd = case.num_decode_tokens
    decode = torch.full((nd, SPEC.num_heads, SPEC.kv_lora_rank), float("nan"))
    prefill = torch.full((case.num_tokens - nd, SPEC.num_heads, SPEC.v_head_dim), float("nan"))
    for batch in batches:
        rank_paged, decode_tokens, decode_out, prefill_rows, prefill_out = _rank_rows(
            case, paged, batch, gathered
        )
        assert_latents_written(case, rank_paged)
        decode[decode_tokens] = decode_out
        prefill[prefill_rows] = prefill_out
    tolerance = MLA_TOLERANCE[SPEC.dtype]
    torch.testing.assert_close(decode.double(), oracle_decode(case), **tolerance)
    torch.testing.assert_close(prefill.double(), oracle_prefill(case), **tolerance)


def test_the_rank_plan_alone_would_miss_the_other_ranks_rows() -> None:
    """The control: writing only the rank's own rows leaves the other rank's chunk out
    of its cache, and its second chunk attends over NaN."""
    query_lens, context_lens, num_decodes = BATCHES["prefill"]
    case = make_mla_case(SPEC, query_lens, context_lens, num_decodes)
    paged = case.paged(np.random.default_rng(0))
    batch = _rank_batches(case, 2)[0]
    tokens = torch.from_numpy(batch.tokens)
    kv_c, k_pe, _ = _gathered_rows(case, paged, [batch])
    own = (kv_c, k_pe, paged.slot_mapping[tokens])
    _, _, _, _, prefill_out = _rank_rows(case, paged, batch, own)
    assert prefill_out.isnan().any(), "rank 0's second chunk saw keys it never wrote"


def test_bad_gathered_slot_mappings_are_refused() -> None:
    case = make_mla_case(SPEC, [4], [0], 0)
    paged = case.paged(np.random.default_rng(0))
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables, None, 0, SPEC)
    with pytest.raises(ValueError, match="slot_mapping must be 1-D"):
        pcp_write_plan(step, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="slot_mapping must hold integers"):
        pcp_write_plan(step, torch.zeros(8))
    with pytest.raises(ValueError, match=r"slot must be < num_blocks \* block_size"):
        pcp_write_plan(step, torch.tensor([0, 10_000]), num_blocks=paged.num_blocks)
    write = pcp_write_plan(step, torch.tensor([-1, 3, -1, 4, 5, 6, -1, -1]))
    assert step.num_actual_tokens == 4 and step.slot_mapping.tolist() == [-1] * 4  # unchanged
    assert write.num_actual_tokens == 8
