"""The ascend provider's torch_npu calls fit torch_npu's schemas and compute the right thing.

Each case plans and runs one layer through ``npu_attention`` with the ascend
provider against the stand-in torch_npu (every call schema-checked, answered by
a reference of what the documentation says the op computes). Outputs are
compared with an independent float64 dense attention and with the reference
provider; the KV caches it writes with the reference provider's.
"""

from __future__ import annotations

import pytest
import torch
from ascend_cases import (
    CASES,
    DTYPE_TOLERANCE,
    Case,
    build_batch,
    dense_reference,
    max_error,
    run_provider,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from stand_in_install import installed_stand_in

from npu_attention import BatchState, plan, register_provider, run

ASCEND_TARGET = "npu_attention.providers.ascend:AscendProvider"
EXPECTED_OPS = {
    True: {
        "npu_scatter_pa_kv_cache",
        "_npu_fused_infer_attention_score_get_max_workspace",
        "npu_fused_infer_attention_score.out",
    },
    False: {"npu_fusion_attention"},
}


@pytest.fixture
def host_ascend() -> str:
    """``provider="ascend"`` resolves to the ascend provider accepting CPU tensors."""
    register_provider("ascend", "ascend_cases:HostAscendProvider")
    yield "ascend"
    register_provider("ascend", ASCEND_TARGET)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_matches_dense_reference_and_reference_provider(case: Case, stand_in, host_ascend) -> None:
    batch = build_batch(case)
    ascend = run_provider(batch, host_ascend)
    reference = run_provider(batch, "reference")
    n = sum(case.query_lens)
    tolerance = DTYPE_TOLERANCE[case.dtype]

    assert max_error(ascend.out[:n], dense_reference(batch)) < tolerance
    assert max_error(ascend.out[:n], reference.out[:n]) < tolerance
    assert torch.equal(ascend.out[n:], torch.zeros_like(ascend.out[n:])), "padding rows written"
    if case.with_cache:
        assert torch.equal(ascend.key_cache, reference.key_cache)
        assert torch.equal(ascend.value_cache, reference.value_cache)
    assert stand_in.log.names() == EXPECTED_OPS[case.with_cache]


def test_step_arguments_follow_the_tnd_conventions(stand_in, host_ascend) -> None:
    case = next(c for c in CASES if c.name == "chunked_prefill_window")
    batch = build_batch(case)
    run_provider(batch, host_ascend)
    (call,) = stand_in.log.of("npu_fused_infer_attention_score.out")
    arguments = call.arguments
    assert arguments["input_layout"] == "TND"
    assert arguments["actual_seq_lengths"] == batch.cu_seqlens_q[1:]
    assert arguments["actual_seq_lengths_kv"] == batch.seq_lens
    assert (arguments["sparse_mode"], arguments["pre_tokens"], arguments["next_tokens"]) == (
        4,
        case.sliding_window - 1,
        0,
    )
    (write,) = stand_in.log.of("npu_scatter_pa_kv_cache")
    assert write.arguments["cache_mode"] == "Norm"
    assert write.arguments["slot_mapping"].shape[0] == sum(case.query_lens)


def test_workspace_is_sized_once_per_call_shape(stand_in, host_ascend) -> None:
    """Layers and later steps of one shape reuse the workspace: an update re-issues one op."""
    batch = build_batch(CASES[1])
    case = batch.case
    for _ in range(2):  # two steps of one shape ...
        step = plan(
            batch.cu_seqlens_q,
            batch.seq_lens,
            batch.block_tables,
            batch.slot_mapping,
            case.num_decodes,
            case.spec,
            provider=host_ascend,
        )
        for _ in range(3):  # ... of three layers each
            out = torch.zeros_like(batch.query)
            run(
                batch.query,
                batch.key,
                batch.value,
                batch.key_cache.clone(),
                batch.value_cache.clone(),
                step,
                out,
            )
    assert len(stand_in.log.of("_npu_fused_infer_attention_score_get_max_workspace")) == 1
    assert len(stand_in.log.of("npu_fused_infer_attention_score.out")) == 6


@st.composite
def random_cases(draw) -> Case:
    num_spec = draw(st.integers(0, 2))
    num_decodes = draw(st.integers(0, 3))
    num_prefills = draw(st.integers(0 if num_decodes else 1, 3))
    contexts = [draw(st.integers(1, 300)) for _ in range(num_decodes)]
    queries = [1 + num_spec] * num_decodes
    for _ in range(num_prefills):
        contexts.append(draw(st.integers(0, 260)))
        queries.append(draw(st.integers(2, 40)))
    if num_decodes == len(queries):
        state = BatchState.SPEC_DECODING if num_spec else BatchState.DECODE_ONLY
    elif num_decodes:
        state = BatchState.CHUNKED_PREFILL
    else:
        state = BatchState.PREFILL_CACHE_HIT if any(contexts) else BatchState.PREFILL_NO_CACHE
    return Case(
        "random",
        state,
        tuple(contexts),
        tuple(queries),
        num_decodes=num_decodes,
        num_speculative_tokens=num_spec,
        num_kv_heads=draw(st.sampled_from([1, 2, 8])),
        sliding_window=draw(st.sampled_from([None, None, 1, 17, 200])),
        padding=draw(st.integers(0, 3)),
    )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(case=random_cases())
def test_random_batches_match_the_reference_provider(torch_npu_api, case: Case) -> None:
    register_provider("ascend-random", "ascend_cases:HostAscendProvider")
    batch = build_batch(case)
    n = sum(case.query_lens)
    with installed_stand_in(torch_npu_api):
        ascend = run_provider(batch, "ascend-random")
    reference = run_provider(batch, "reference")
    assert max_error(ascend.out[:n], reference.out[:n]) < DTYPE_TOLERANCE[case.dtype]
    assert torch.equal(ascend.key_cache, reference.key_cache)
