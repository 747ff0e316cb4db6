"""Context parallelism with the reference provider: the DCP sharding rule, the LSE that
``run`` returns, the merge, and DCP / PCP attention rank by rank against unsharded
attention in every batch state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from context_parallel_cases import dcp_attention, dcp_rank_cache, pcp_attention
from npu_attention_cases import TOLERANCE, make_case, naive_attention, run_case

from npu_attention import AttentionSpec, merge_attention_states, plan, plan_context, run
from npu_attention.context_parallel import (
    dcp_local_positions,
    dcp_local_seq_lens,
    dcp_owner,
    dcp_slot_mapping,
    pcp_query_chunks,
)

# (query_lens, context_lens, num_decodes, num_speculative_tokens) per batch state
STATES = {
    "prefill_no_cache": ([5, 17, 1], [0, 0, 0], 0, 0),
    "prefill_cache_hit": ([3, 9], [21, 0], 0, 0),
    "decode_only": ([1, 1, 1, 1], [1, 0, 40, 7], 4, 0),
    "spec_decoding": ([3, 2, 3], [12, 1, 33], 3, 2),
    "chunked_prefill": ([1, 1, 6, 13], [30, 2, 11, 0], 2, 0),
}


def _spec(num_speculative_tokens: int = 0, **kw) -> AttentionSpec:
    args = dict(num_heads=4, num_kv_heads=1, head_size=32, block_size=16, dtype=torch.float32)
    args.update(kw)
    return AttentionSpec(**args, num_speculative_tokens=num_speculative_tokens)


def _brute_local_lens(seq_lens: list[int], n: int, i: int) -> np.ndarray:
    return np.array(
        [[sum((p // i) % n == r for p in range(s)) for r in range(n)] for s in seq_lens]
    )


@pytest.mark.parametrize(("dcp_size", "interleave"), [(1, 1), (2, 1), (3, 2), (4, 16)])
def test_dcp_local_seq_lens_follow_the_interleaving(dcp_size: int, interleave: int) -> None:
    seq_lens = [0, 1, 2, 5, 16, 31, 64, 97]
    local = dcp_local_seq_lens(seq_lens, dcp_size, interleave)
    np.testing.assert_array_equal(local, _brute_local_lens(seq_lens, dcp_size, interleave))
    assert (local.sum(axis=1) == seq_lens).all()
    for rank in range(dcp_size):
        np.testing.assert_array_equal(
            dcp_local_seq_lens(seq_lens, dcp_size, interleave, rank), local[:, rank]
        )
    pos = np.arange(97)
    owner, index = (
        dcp_owner(pos, dcp_size, interleave),
        dcp_local_positions(pos, dcp_size, interleave),
    )
    for rank in range(dcp_size):  # a rank's tokens are numbered 0, 1, 2, ... in order
        np.testing.assert_array_equal(index[owner == rank], np.arange((owner == rank).sum()))


def test_dcp_slot_mapping_puts_each_rank_share_in_its_pages() -> None:
    block_size, dcp_size, interleave = 16, 2, 4
    tables = np.array([[5, 9, 3]])
    pos = np.arange(70)
    for rank in range(dcp_size):
        slots = dcp_slot_mapping(
            pos, np.zeros(70, int), tables, block_size, dcp_size, rank, interleave
        )
        mine = dcp_owner(pos, dcp_size, interleave) == rank
        assert (slots[~mine] == -1).all()
        local = np.arange(mine.sum())  # the rank's j-th token at page j // B of the same table
        np.testing.assert_array_equal(
            slots[mine], tables[0, local // block_size] * block_size + local % block_size
        )
    with pytest.raises(ValueError, match="multiple of interleave_size"):
        dcp_slot_mapping(pos, np.zeros(70, int), tables, 16, 2, 0, 3)


def test_merge_weights_parts_by_lse_and_ignores_empty_shards() -> None:
    gen = torch.Generator().manual_seed(0)
    outputs = torch.randn(3, 5, 2, 8, generator=gen)
    lses = torch.randn(3, 5, 2, generator=gen)
    lses[1, :2] = float("-inf")  # shard 1 saw no key for tokens 0 and 1 ...
    outputs[1, :2] = float("nan")  # ... and its rows hold anything
    lses[:, 4, 1] = float("-inf")  # no shard saw a key: zeros and -inf
    out, lse = merge_attention_states(outputs, lses)
    weights = torch.softmax(lses, dim=0).nan_to_num(0.0)
    expected = (outputs.nan_to_num(0.0) * weights[..., None]).sum(0)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse[:4], torch.logsumexp(lses, dim=0)[:4])
    assert lse[4, 1] == float("-inf") and (out[4, 1] == 0).all()
    dest, dest_lse = torch.empty(5, 2, 8), torch.empty(5, 2)
    merge_attention_states(outputs, lses, out=dest, out_lse=dest_lse)
    torch.testing.assert_close(dest, out)
    with pytest.raises(TypeError, match="float32"):
        merge_attention_states(outputs, lses.double())
    with pytest.raises(ValueError, match="parts, tokens, heads"):
        merge_attention_states(outputs, lses[:, :, 0])


def _oracle_lse(case) -> torch.Tensor:
    """float64 LSE of every query row over the keys it sees (the oracle's masking)."""
    spec = case.spec
    group = spec.num_heads // spec.num_kv_heads
    rows = []
    for i, (ctx, seq) in enumerate(zip(case.context_lens, case.seq_lens)):
        keys = case.keys[i].double().repeat_interleave(group, dim=1)
        for t in range(case.query_lens[i]):
            q = case.query[case.cu_seqlens_q[i] + t].double()
            visible = keys[: ctx + t + 1] if spec.causal else keys[:seq]
            rows.append(
                torch.einsum("hd,jhd->hj", q, visible).mul(spec.softmax_scale).logsumexp(-1)
            )
    return torch.stack(rows)


@pytest.mark.parametrize("state", sorted(STATES))
def test_run_returns_the_lse(state: str) -> None:
    query_lens, context_lens, num_decodes, spec_tokens = STATES[state]
    case = make_case(_spec(spec_tokens), query_lens, context_lens, num_decodes, seed=1)
    paged = case.paged(np.random.default_rng(1))
    step = plan(
        case.cu_seqlens_q,
        case.seq_lens,
        paged.block_tables,
        paged.slot_mapping,
        case.num_decodes,
        case.spec,
        provider="reference",
    )
    key, value = case.new_kv()
    out = torch.empty_like(case.query)
    lse = torch.full((case.num_tokens + 2, 4), 5.0)
    run(case.query, key, value, paged.key_cache, paged.value_cache, step, out, lse=lse)
    torch.testing.assert_close(
        lse[: case.num_tokens].double(), _oracle_lse(case), atol=1e-5, rtol=1e-5
    )
    assert (lse[case.num_tokens :] == 5.0).all(), "rows past the step's tokens are left alone"
    expected, _, _ = run_case(case, 1)  # asking for the LSE changes nothing in out
    torch.testing.assert_close(out[: case.num_tokens], expected[: case.num_tokens])


def test_run_refuses_a_bad_lse() -> None:
    case = make_case(_spec(), [2], [3], 0)
    out, paged, step = run_case(case)
    for lse, error, match in [
        (torch.empty(2, 4, dtype=torch.float16), TypeError, "float32"),
        (torch.empty(1, 4), ValueError, "num_actual_tokens"),
        (torch.empty(2, 3), ValueError, r"\[>= num_actual_tokens=2, 4\]"),
    ]:
        with pytest.raises(error, match=match):
            run(case.query, None, None, paged.key_cache, paged.value_cache, step, out, lse=lse)


def test_run_refuses_lse_from_a_provider_that_does_not_return_it(monkeypatch) -> None:
    case = make_case(_spec(), [2], [3], 0)
    out, paged, step = run_case(case)
    monkeypatch.setattr(step.provider, "returns_lse", False)
    with pytest.raises(ValueError, match=r"'reference' does not return the log-sum-exp"):
        run(case.query, None, None, paged.key_cache, paged.value_cache, step, out,
            lse=torch.empty(2, 4))  # fmt: skip


def test_plan_context_sees_only_cached_keys_and_empty_shards_give_minus_inf() -> None:
    spec = _spec()
    case = make_case(spec, [3, 1, 2], [2, 0, 40], 0, seed=3)
    paged = case.paged(np.random.default_rng(3))
    step = plan_context(
        case.cu_seqlens_q, case.context_lens, paged.block_tables, 0, spec, provider="reference"
    )
    assert step.seq_lens_host == case.context_lens and not step.spec.causal
    out = torch.full_like(case.query, float("nan"))
    lse = torch.empty(case.num_tokens, 4)
    run(case.query, None, None, paged.key_cache, paged.value_cache, step, out, lse=lse)
    assert (lse[3] == float("-inf")).all() and (out[3] == 0).all()  # request 1 has no context
    for i, start in ((0, 0), (2, 4)):  # every row sees the whole context
        ctx = case.context_lens[i]
        q = case.query[start : start + case.query_lens[i]].double()
        k = case.keys[i][:ctx].double().expand(ctx, 4, 32)
        v = case.values[i][:ctx].double().expand(ctx, 4, 32)
        scores = torch.einsum("qhd,khd->hqk", q, k) * spec.softmax_scale
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        rows = slice(start, start + case.query_lens[i])
        torch.testing.assert_close(out[rows].double(), expected, **TOLERANCE[torch.float32])
        torch.testing.assert_close(lse[rows].double(), scores.logsumexp(-1).T, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sliding_window"):
        plan_context([0, 1], [4], paged.block_tables[:1], 0, _spec(sliding_window=8))


def test_plan_context_with_a_slot_mapping_writes_the_rank_share_of_new_tokens() -> None:
    """A rank's DCP slot mapping in ``plan_context``: ``run`` writes the new keys and
    values the rank keeps (and no other), and attends as without the writes."""
    spec = _spec()
    case = make_case(spec, [1, 1, 5], [9, 0, 6], 2, seed=5)
    paged = case.paged(np.random.default_rng(5))
    key, value = case.new_kv()
    n, tables = case.num_tokens, paged.block_tables.numpy()
    request = np.repeat(np.arange(3), case.query_lens)
    positions = np.concatenate(
        [np.arange(c, c + q) for c, q in zip(case.context_lens, case.query_lens)]
    )
    for rank in range(2):
        key_cache, value_cache = dcp_rank_cache(case, paged, 2, rank, 1)
        context = dcp_local_seq_lens(case.context_lens, 2, 1, rank)
        slots = dcp_slot_mapping(positions, request, tables, spec.block_size, 2, rank)
        outs = []
        for writes in (None, slots):
            step = plan_context(
                case.cu_seqlens_q, context, paged.block_tables, 2, spec, slot_mapping=writes
            )
            out, lse = torch.empty_like(case.query), torch.empty(n, 4)
            caches = (key_cache.clone(), value_cache.clone())
            run(case.query, key[:n], value[:n], *caches, step, out, lse=lse)
            outs.append((out[:n], lse[:n], caches))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=0)
        mine = torch.from_numpy(np.flatnonzero(slots >= 0))
        kept = torch.from_numpy(slots[slots >= 0])
        written_k, written_v = outs[1][2]
        bs = spec.block_size
        torch.testing.assert_close(written_k[kept // bs, kept % bs], key[mine])
        torch.testing.assert_close(written_v[kept // bs, kept % bs], value[mine])
        written_k[kept // bs, kept % bs] = key_cache[kept // bs, kept % bs]
        torch.testing.assert_close(written_k, key_cache, equal_nan=True)  # nothing else


@pytest.mark.parametrize("state", sorted(STATES))
@pytest.mark.parametrize(("dcp_size", "interleave"), [(2, 1), (3, 16)])
def test_dcp_shards_merged_equal_unsharded_attention(
    state: str, dcp_size: int, interleave: int
) -> None:
    query_lens, context_lens, num_decodes, spec_tokens = STATES[state]
    case = make_case(_spec(spec_tokens), query_lens, context_lens, num_decodes, seed=dcp_size)
    paged = case.paged(np.random.default_rng(dcp_size))
    out = dcp_attention(case, paged, dcp_size, interleave, "reference")
    torch.testing.assert_close(out.double(), naive_attention(case), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("seed", range(4))
def test_dcp_random_batches(seed: int) -> None:
    rng = np.random.default_rng(seed)
    spec_tokens = int(rng.integers(0, 3))
    num_decodes = int(rng.integers(0, 4))
    num_prefills = int(rng.integers(0 if num_decodes else 1, 3))
    query_lens = [int(rng.integers(1, spec_tokens + 2)) for _ in range(num_decodes)]
    query_lens += [int(rng.integers(1, 20)) for _ in range(num_prefills)]
    context_lens = [int(rng.integers(0, 60)) for _ in query_lens]
    dtype = [torch.float32, torch.float16, torch.bfloat16][seed % 3]
    spec = _spec(
        spec_tokens,
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        dtype=dtype,
        logits_soft_cap=None if seed % 2 else 30.0,
    )
    case = make_case(spec, query_lens, context_lens, num_decodes, seed=seed)
    paged = case.paged(rng)
    dcp_size, interleave = int(rng.integers(2, 5)), int(rng.choice([1, 2, 16]))
    out = dcp_attention(case, paged, dcp_size, interleave, "reference")
    expected, _, _ = run_case(case, seed)
    torch.testing.assert_close(out, expected[: case.num_tokens], **TOLERANCE[dtype])


def test_pcp_query_chunks_follow_vllm_dual_chunk_swap() -> None:
    # PCP=4: 8 chunks of a 16-token prefill; rank r gets chunks r and 7 - r.
    for rank in range(4):
        chunks = pcp_query_chunks([16], 0, 4, rank)
        assert chunks == [(0, 2 * rank, 2), (0, 2 * (7 - rank), 2)]
    # A decode is computed whole on every rank, listed first. A 5-token prefill in 4
    # chunks of 2: [0, 2) [2, 4) [4, 5) and an empty fourth; rank 0 gets chunks 0 and 3.
    assert pcp_query_chunks([1, 5], 1, 2, 0) == [(0, 0, 1), (1, 0, 2)]
    assert pcp_query_chunks([1, 5], 1, 2, 1) == [(0, 0, 1), (1, 2, 2), (1, 4, 1)]
    # With DCP, a prefill whose last chunk is empty is computed whole on every rank.
    assert pcp_query_chunks([5], 0, 2, 1, dcp_size=2) == [(0, 0, 5)]


@pytest.mark.parametrize("state", sorted(STATES))
@pytest.mark.parametrize(("pcp_size", "dcp_size"), [(2, 1), (3, 1), (2, 2)])
def test_pcp_chunks_equal_unsharded_attention(state: str, pcp_size: int, dcp_size: int) -> None:
    query_lens, context_lens, num_decodes, spec_tokens = STATES[state]
    case = make_case(_spec(spec_tokens), query_lens, context_lens, num_decodes, seed=pcp_size)
    paged = case.paged(np.random.default_rng(pcp_size))
    out = pcp_attention(case, paged, pcp_size, "reference", dcp_size)
    torch.testing.assert_close(out.double(), naive_attention(case), **TOLERANCE[torch.float32])
