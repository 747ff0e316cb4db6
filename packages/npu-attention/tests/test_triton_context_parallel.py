"""The ``triton`` provider's log-sum-exp (``run(..., lse=)``) and DCP attention through it.

Against a float64 oracle: each row's natural-log LSE over the keys it sees, within
``LSE_TOLERANCE`` (absolute and relative; LSEs here are O(1) to O(10)). The kernels
keep scores in log2 units; these tests check the conversion, the split-decode merge
(which writes the combined LSE), and rows with no visible key (``-inf``, zeros).

Unmarked cases are small and run on the CPU through Triton's interpreter; cases
marked ``cuda`` repeat them in 16-bit dtypes on a GPU, inside a CUDA graph too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from context_parallel_cases import dcp_attention, dcp_rank_cache
from npu_attention_cases import TOLERANCE, Case, make_case, naive_attention
from triton_interpreter import DEVICE, HAS_CUDA

from npu_attention import AttentionSpec, PlanBuffers, plan, plan_context, run
from npu_attention.context_parallel import dcp_local_seq_lens
from npu_attention.providers.triton import TritonProvider, TritonStepData

pytest.importorskip("triton")

# The LSE is a sum of float32 exponentials of float32 scores (inputs are rounded to the
# dtype before the oracle sees them), so one tolerance serves every dtype.
LSE_TOLERANCE = dict(atol=2e-5, rtol=2e-5) if not HAS_CUDA else dict(atol=1e-4, rtol=1e-4)

# (query_lens, context_lens, num_decodes, num_speculative_tokens) per batch state
STATES = {
    "prefill_no_cache": ([5, 9, 1], [0, 0, 0], 0, 0),
    "prefill_cache_hit": ([3, 6], [21, 0], 0, 0),
    "decode_only": ([1, 1, 1, 1], [1, 0, 40, 7], 4, 0),
    "spec_decoding": ([3, 2, 3], [12, 1, 33], 3, 2),
    "chunked_prefill": ([1, 1, 6, 5], [30, 2, 11, 0], 2, 0),
}


def _spec(num_speculative_tokens: int = 0, **overrides: object) -> AttentionSpec:
    args = dict(num_heads=4, num_kv_heads=2, head_size=32, block_size=16)
    args["dtype"] = torch.bfloat16 if HAS_CUDA else torch.float32
    args.update(overrides)
    return AttentionSpec(**args, num_speculative_tokens=num_speculative_tokens)


def oracle_lse(case: Case, context_only: bool = False) -> torch.Tensor:
    """float64 ``[num_tokens, heads]``: each row's LSE over the keys it sees (with
    ``context_only``, over its request's cached keys, all visible); ``-inf`` if none."""
    spec = case.spec
    group = spec.num_heads // spec.num_kv_heads
    rows = []
    for i, (ctx, seq) in enumerate(zip(case.context_lens, case.seq_lens)):
        keys = case.keys[i].double().repeat_interleave(group, dim=1).cpu()
        for t in range(case.query_lens[i]):
            q = case.query[case.cu_seqlens_q[i] + t].double().cpu()
            pos = ctx + t
            if context_only:
                visible = list(range(ctx))
            else:
                visible = [j for j in range(seq) if _visible(spec, pos, j)]
            scores = torch.einsum("hd,jhd->hj", q, keys[visible]) * spec.softmax_scale
            if spec.logits_soft_cap is not None:
                scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
            rows.append(scores.logsumexp(-1))
    return torch.stack(rows)


def _visible(spec: AttentionSpec, query_pos: int, key_pos: int) -> bool:
    if spec.causal and key_pos > query_pos:
        return False
    return spec.sliding_window is None or abs(query_pos - key_pos) < spec.sliding_window


def split_provider() -> TritonProvider:
    """A provider that splits every decode request's keys into shares of 16 tokens."""
    provider = TritonProvider()
    provider.min_tokens_per_split = 16
    provider.target_waves = 64
    provider.min_unsplit_fill = float("inf")
    return provider


def _run_with_lse(case: Case, provider: TritonProvider | None = None, pad_rows: int = 2):
    """plan + run with ``lse=`` over ``case``; returns (out, lse, plan)."""
    paged = case.paged(np.random.default_rng(0))
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables.to(DEVICE),
                paged.slot_mapping.to(DEVICE), case.num_decodes, case.spec,
                provider="triton")  # fmt: skip
    if provider is not None:
        step.provider, step.provider_data = provider, provider.prepare(step)
    key, value = case.new_kv()
    out = torch.full_like(case.query, -3.0)
    lse = torch.full((case.query.shape[0] + pad_rows, case.spec.num_heads), 5.0, device=DEVICE)
    run(case.query, key, value, paged.key_cache, paged.value_cache, step, out, lse=lse)
    return out, lse, step


def assert_lse_close(lse: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(lse.double().cpu(), expected, **LSE_TOLERANCE)


# ---------------------------------------------------------------- interpreter (CPU) cases


def test_triton_provider_declares_lse() -> None:
    assert TritonProvider.returns_lse


@pytest.mark.parametrize("state", sorted(STATES))
def test_lse_matches_float64_oracle(state: str) -> None:
    query_lens, context_lens, num_decodes, spec_tokens = STATES[state]
    case = make_case(_spec(spec_tokens), query_lens, context_lens, num_decodes, seed=1,
                     pad_tokens=1, device=DEVICE)  # fmt: skip
    out, lse, _ = _run_with_lse(case)
    n = case.num_tokens
    assert_lse_close(lse[:n], oracle_lse(case))
    assert (lse[n:] == 5.0).all(), "rows past the step's tokens are left alone"
    torch.testing.assert_close(out[:n].double().cpu(), naive_attention(case).cpu(),
                               **TOLERANCE[case.spec.dtype])  # fmt: skip


@pytest.mark.parametrize(
    "overrides",
    [{"logits_soft_cap": 2.0}, {"sliding_window": 5}, {"num_heads": 3, "num_kv_heads": 1}],
    ids=["soft_cap", "sliding_window", "mqa"],
)
def test_lse_with_soft_cap_window_and_mqa(overrides: dict) -> None:
    case = make_case(_spec(**overrides), [1, 6], [20, 9], 1, seed=2, device=DEVICE)
    _, lse, _ = _run_with_lse(case)
    assert_lse_close(lse[: case.num_tokens], oracle_lse(case))


def test_split_decode_merge_writes_the_combined_lse() -> None:
    """Forced KV splits: the merge kernel combines the splits' log2 LSEs and converts;
    a request shorter than one share leaves later splits empty (-inf partials)."""
    case = make_case(_spec(), [1, 1, 1], [70, 3, 40], 3, seed=3, pad_tokens=1, device=DEVICE)
    out, lse, step = _run_with_lse(case, split_provider())
    assert step.provider_data.num_kv_splits > 1
    n = case.num_tokens
    assert_lse_close(lse[:n], oracle_lse(case))
    assert (lse[n:] == 5.0).all()
    torch.testing.assert_close(out[:n].double().cpu(), naive_attention(case).cpu(),
                               **TOLERANCE[case.spec.dtype])  # fmt: skip


@pytest.mark.parametrize(
    ("decode", "split"),
    [(False, False), (True, False), (True, True)],
    ids=["varlen_tiles", "decode_tiles", "split_decode"],
)
def test_plan_context_rows_with_no_key_get_minus_inf_and_zeros(decode: bool, split: bool) -> None:
    """A rank whose share of a request's context is empty (``context_lens`` 0)."""
    query_lens = [1, 1, 1] if decode else [2, 3, 1]
    case = make_case(_spec(), query_lens, [35, 0, 9], 3 if decode else 0, seed=4, device=DEVICE)
    paged = case.paged(np.random.default_rng(4))
    step = plan_context(case.cu_seqlens_q, case.context_lens, paged.block_tables.to(DEVICE),
                        case.num_decodes, case.spec, provider="triton")  # fmt: skip
    if split:
        provider = split_provider()
        step.provider, step.provider_data = provider, provider.prepare(step)
        assert step.provider_data.num_kv_splits > 1
    out = torch.full_like(case.query, float("nan"))
    lse = torch.full((case.num_tokens, 4), float("nan"), device=DEVICE)
    run(case.query, None, None, paged.key_cache, paged.value_cache, step, out, lse=lse)
    expected = oracle_lse(case, context_only=True)
    keyless = slice(case.cu_seqlens_q[1], case.cu_seqlens_q[2])
    assert (lse[keyless] == float("-inf")).all() and (out[keyless] == 0).all()
    assert_lse_close(lse, expected)


@pytest.mark.parametrize("state", sorted(STATES))
def test_dcp_shards_merged_equal_unsharded_attention(state: str) -> None:
    query_lens, context_lens, num_decodes, spec_tokens = STATES[state]
    spec = _spec(spec_tokens, num_kv_heads=1)
    case = make_case(spec, query_lens, context_lens, num_decodes, seed=5, device=DEVICE)
    paged = case.paged(np.random.default_rng(5))
    lses: list[torch.Tensor] = []
    out = dcp_attention(case, paged, 2, 1, "triton", lses)
    torch.testing.assert_close(
        out.double().cpu(), naive_attention(case).cpu(), **TOLERANCE[spec.dtype]
    )


@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_plan_context_replay_reads_refreshed_rank_lengths(split: bool) -> None:
    """The rank's context lengths are a step argument: a plan_context made in fixed
    buffers for 4 decodes (as captured) launched after the next step, of 2 decodes, was
    planned into the same buffers, as a graph replay does: it reads that step's lengths,
    the 2 padded requests get length 0 and their rows stay untouched."""
    spec, rank, dcp_size = _spec(), 1, 2
    buffers = PlanBuffers.allocate(4, 8, 8, device=DEVICE)
    captured_case = make_case(spec, [1] * 4, [40, 5, 17, 30], 4, seed=7, device=DEVICE)
    captured_paged = captured_case.paged(np.random.default_rng(7))
    captured = plan_context(
        captured_case.cu_seqlens_q,
        dcp_local_seq_lens(captured_case.context_lens, dcp_size, 1, rank),
        captured_paged.block_tables.to(DEVICE), 4, spec, provider="triton", buffers=buffers,
    )  # fmt: skip
    if split:
        provider = split_provider()
        captured.provider, captured.provider_data = provider, provider.prepare(captured)
        assert captured.provider_data.num_kv_splits > 1
    real = make_case(spec, [1, 1], [21, 6], 2, seed=8, device=DEVICE)
    paged = real.paged(np.random.default_rng(8))
    key_cache, value_cache = dcp_rank_cache(real, paged, dcp_size, rank, 1)
    local = dcp_local_seq_lens(real.context_lens, dcp_size, 1, rank)
    fresh = plan_context(real.cu_seqlens_q, local, paged.block_tables.to(DEVICE), 2, spec,
                         provider="triton", buffers=buffers)  # fmt: skip
    assert buffers.seq_lens.tolist() == [*local.tolist(), 0, 0]
    assert captured.seq_lens.data_ptr() == fresh.seq_lens.data_ptr()
    query = torch.cat([real.query, torch.full_like(real.query, float("nan"))])
    out = torch.full_like(query, float("nan"))
    lse = torch.full((4, spec.num_heads), 5.0, device=DEVICE)
    run(query, None, None, key_cache, value_cache, captured, out, lse=lse)
    expected_lse = oracle_lse(_rank_share(real, local, rank, dcp_size), context_only=True)
    assert_lse_close(lse[:2], expected_lse)
    assert out[2:].isnan().all() and (lse[2:] == 5.0).all()


def _rank_share(case: Case, local_lens: np.ndarray, rank: int, dcp_size: int) -> Case:
    """``case`` with each request's context cut to the tokens DCP rank ``rank`` keeps
    (interleave 1: positions ``rank, rank + N, ...``), for the oracle."""
    keys = [k[rank:c:dcp_size] for k, c in zip(case.keys, case.context_lens)]
    values = [v[rank:c:dcp_size] for v, c in zip(case.values, case.context_lens)]
    assert [len(k) for k in keys] == local_lens.tolist()
    return Case(case.spec, case.query_lens, local_lens.tolist(), case.num_decodes,
                case.query, keys, values, 0)  # fmt: skip


# ---------------------------------------------------------------- GPU cases


def _gpu_spec(dtype: torch.dtype, block_size: int = 16, spec_tokens: int = 0) -> AttentionSpec:
    return _spec(spec_tokens, num_heads=32, num_kv_heads=8, head_size=128,
                 block_size=block_size, dtype=dtype)  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("state", sorted(STATES))
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_lse_matches_float64_oracle(state: str, dtype: torch.dtype, block_size: int) -> None:
    query_lens, context_lens, num_decodes, spec_tokens = STATES[state]
    query_lens = [q if i < num_decodes else 7 * q for i, q in enumerate(query_lens)]
    context_lens = [9 * c for c in context_lens]
    spec = _gpu_spec(dtype, block_size, spec_tokens)
    case = make_case(spec, query_lens, context_lens, num_decodes, seed=11, pad_tokens=3,
                     device="cuda")  # fmt: skip
    out, lse, _ = _run_with_lse(case)
    n = case.num_tokens
    assert_lse_close(lse[:n], oracle_lse(case))
    assert (lse[n:] == 5.0).all()
    torch.testing.assert_close(
        out[:n].double().cpu(), naive_attention(case).cpu(), **TOLERANCE[dtype]
    )


@pytest.mark.cuda
@pytest.mark.parametrize("num_kv_splits", [2, 7, 33])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_split_decode_lse(num_kv_splits: int, block_size: int) -> None:
    """Forced splits, some of them empty for the short requests, merged with their LSE."""
    spec = _gpu_spec(torch.bfloat16, block_size)
    case = make_case(spec, [1] * 4, [700, 3, 0, 260], 4, seed=12, pad_tokens=2, device="cuda")
    paged = case.paged(np.random.default_rng(12))
    step = plan_context(case.cu_seqlens_q, case.context_lens, paged.block_tables.cuda(), 4,
                        spec, provider="triton")  # fmt: skip
    step.provider_data = TritonStepData(decode_tiles=True, num_kv_splits=num_kv_splits)
    out = torch.full_like(case.query, float("nan"))
    lse = torch.full((case.query.shape[0], 32), 5.0, device="cuda")
    run(case.query, None, None, paged.key_cache, paged.value_cache, step, out, lse=lse)
    assert_lse_close(lse[:4], oracle_lse(case, context_only=True))
    assert (lse[2] == float("-inf")).all() and (out[2] == 0).all()
    assert (lse[4:] == 5.0).all() and out[4:].isnan().all()


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(4))
def test_gpu_dcp_random_batches(seed: int) -> None:
    rng = np.random.default_rng(seed)
    spec_tokens = int(rng.integers(0, 3))
    num_decodes = int(rng.integers(1, 6))
    query_lens = [int(rng.integers(1, spec_tokens + 2)) for _ in range(num_decodes)]
    query_lens += [int(rng.integers(1, 90)) for _ in range(int(rng.integers(0, 3)))]
    context_lens = [int(rng.integers(0, 600)) for _ in query_lens]
    dtype = [torch.bfloat16, torch.float16][seed % 2]
    spec = _spec(spec_tokens, num_heads=16, num_kv_heads=1, head_size=128, dtype=dtype,
                 block_size=[16, 128][seed % 2])  # fmt: skip
    case = make_case(spec, query_lens, context_lens, num_decodes, seed=seed, device="cuda")
    paged = case.paged(rng)
    dcp_size, interleave = int(rng.integers(2, 5)), int(rng.choice([1, 16]))
    out = dcp_attention(case, paged, dcp_size, interleave, "triton")
    torch.testing.assert_close(out.double().cpu(), naive_attention(case).cpu(), **TOLERANCE[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("num_kv_splits", [1, 5])
def test_gpu_plan_context_graph_replay_reads_refreshed_rank_lengths(num_kv_splits: int) -> None:
    """A CUDA graph of a rank's context attention (LSE included), captured for 4 decodes
    in fixed buffers, replayed after the next step of 2 decodes is planned into them:
    equal to that step run eagerly, padded requests untouched, no host sync in run."""
    spec, rank, dcp_size = _gpu_spec(torch.bfloat16), 1, 2
    real = make_case(spec, [1, 1], [300, 41], 2, seed=13, device="cuda")
    paged = real.paged(np.random.default_rng(13))
    key_cache, value_cache = dcp_rank_cache(real, paged, dcp_size, rank, 1)
    buffers = PlanBuffers.allocate(4, 8, 32, device="cuda")
    tables = torch.zeros(4, paged.block_tables.shape[1], dtype=torch.int64)
    tables[:2] = paged.block_tables
    captured = plan_context([0, 1, 2, 3, 4], [120, 7, 33, 64], tables.cuda(), 4, spec,
                            provider="triton", buffers=buffers)  # fmt: skip
    captured.provider_data = TritonStepData(decode_tiles=True, num_kv_splits=num_kv_splits)
    query = torch.full((4, 32, 128), float("nan"), dtype=spec.dtype, device="cuda")
    out = torch.full_like(query, float("nan"))
    lse = torch.full((4, 32), 5.0, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        run(query, None, None, key_cache, value_cache, captured, out, lse=lse)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(query, None, None, key_cache, value_cache, captured, out, lse=lse)

    local = dcp_local_seq_lens(real.context_lens, dcp_size, 1, rank)
    fresh = plan_context(real.cu_seqlens_q, local, paged.block_tables.cuda(), 2, spec,
                         provider="triton", buffers=buffers)  # fmt: skip
    query[:2].copy_(real.query)
    out.fill_(float("nan"))
    lse.fill_(5.0)
    graph.replay()
    torch.cuda.synchronize()
    assert buffers.seq_lens.tolist() == [*local.tolist(), 0, 0]
    expected_lse = oracle_lse(_rank_share(real, local, rank, dcp_size), context_only=True)
    assert_lse_close(lse[:2], expected_lse)
    assert out[2:].isnan().all() and (lse[2:] == 5.0).all()
    eager_out, eager_lse = torch.empty_like(real.query), torch.empty(2, 32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(real.query, None, None, key_cache, value_cache, fresh, eager_out, lse=eager_lse)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out[:2], eager_out, **TOLERANCE[spec.dtype])
    torch.testing.assert_close(lse[:2], eager_lse, **LSE_TOLERANCE)
