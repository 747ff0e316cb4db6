"""The ascend MLA provider's torch_npu calls fit torch_npu's schemas and compute the right thing.

Each case plans and runs one layer (latent write, absorbed decode, decompressed
prefill) through ``npu_attention.mla`` with the ascend MLA provider against the
stand-in torch_npu, and compares with a float64 MLA oracle and with the reference
MLA provider. Providers with one deliberate mistake each must be caught: by a
schema or documented-value check, or by missing the oracle.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from ascend_cases import max_error
from ascend_mla_cases import (
    MLA_CASES,
    MLA_TOLERANCE,
    build_mla_batch,
    mla_reference,
    run_mla_provider,
)
from ascend_mla_dcp_cases import DcpBatch
from call_sites import calls_through
from torch_npu_schemas import SchemaViolation

import npu_attention.providers.ascend_mla as ascend_mla_module
from npu_attention import plan, register_provider
from npu_attention.mla import MLASpec, mla_decode, split_latent_cache

ASCEND_MLA_TARGET = "npu_attention.providers.ascend_mla:AscendMLAProvider"
FAULTY = "faulty_ascend_mla_providers"
CALLS = {
    "_npu_fused_infer_attention_score_v2_get_max_workspace",
    "npu_fused_infer_attention_score_v2.out",
    "npu_fused_infer_attention_score_v2",
    "atb.npu_multi_head_latent_attention",
    "atb._npu_multi_head_latent_attention_get_workspace",
}


@pytest.fixture
def host_ascend_mla():
    """``provider="ascend"`` resolves to the ascend MLA provider accepting CPU tensors."""
    register_provider("ascend", "ascend_mla_cases:HostAscendMLAProvider", family="mla")
    yield "ascend"
    register_provider("ascend", ASCEND_MLA_TARGET, family="mla")


def _case(name: str):
    return next(case for case in MLA_CASES if case.name == name)


def _errors(outcome, batch) -> tuple[float, float]:
    decode, prefill = mla_reference(batch)
    nd, npf = decode.shape[0], prefill.shape[0]
    return max_error(outcome.decode_out[:nd], decode), max_error(outcome.prefill_out[:npf], prefill)


@pytest.mark.parametrize("case", MLA_CASES, ids=lambda case: case.name)
def test_matches_oracle_and_reference_provider(case, stand_in, host_ascend_mla) -> None:
    batch = build_mla_batch(case)
    ascend = run_mla_provider(batch, host_ascend_mla)
    reference = run_mla_provider(batch, "reference")
    tolerance = MLA_TOLERANCE[case.dtype]
    assert max(_errors(ascend, batch)) < tolerance
    nd, npf = ascend.decode_out.shape[0] - case.padding, ascend.prefill_out.shape[0] - case.padding
    assert max_error(ascend.decode_out[:nd], reference.decode_out[:nd]) < tolerance
    assert max_error(ascend.prefill_out[:npf], reference.prefill_out[:npf]) < tolerance
    assert not ascend.decode_out[nd:].any() and not ascend.prefill_out[npf:].any(), "padding"
    for plane, expected in zip(ascend.cache, reference.cache):
        assert torch.equal(plane.nan_to_num(), expected.nan_to_num())
    used = {call.name for call in stand_in.log.calls}
    assert "npu_scatter_pa_kv_cache" in used
    assert ("npu_fused_infer_attention_score_v2.out" in used) == (case.num_decodes > 0)
    assert ("npu_fused_infer_attention_score_v2" in used) == (
        case.num_decodes < len(case.query_lens)
    )


def test_every_call_site_runs_under_the_schema_checks(stand_in, host_ascend_mla) -> None:
    sites = calls_through(Path(ascend_mla_module.__file__), set(), {"torch_npu_module"})
    assert sites == CALLS
    for case in MLA_CASES:
        run_mla_provider(build_mla_batch(case), host_ascend_mla)
    lse_batch = DcpBatch(_case("decode_only").spec, [1, 1], [3, 0])  # the LSE decode
    lse_batch.rank_part(host_ascend_mla, 2, 0, 1)
    # The latent write goes through the attention provider's scatter_rows (ascend.py).
    assert sites | {"npu_scatter_pa_kv_cache"} <= stand_in.log.names()


def test_decode_call_records_the_documented_arguments(stand_in, host_ascend_mla) -> None:
    batch = build_mla_batch(_case("spec_decoding"))
    run_mla_provider(batch, host_ascend_mla)
    (call,) = stand_in.log.of("npu_fused_infer_attention_score_v2.out")
    arguments = call.arguments
    assert arguments["input_layout"] == "TND" and arguments["sparse_mode"] == 3
    assert arguments["actual_seq_qlen"] == [3, 6]  # cumulative query ends
    assert arguments["actual_seq_kvlen"] == [15, 43]  # per-request KV lengths
    assert arguments["num_query_heads"] == 64 and arguments["num_key_value_heads"] == 1


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"kv_lora_rank": 256}, ValueError, r"needs kv_lora_rank, .* = \(512, 64, 128, 128\)"),
        ({"v_head_dim": 64}, ValueError, r"the fused op's MLA shapes\), got \(512, 64, 128, 64\)"),
        ({"num_heads": 256}, ValueError, r"takes up to 128 query heads .*got num_heads=256"),
        ({"block_size": 64}, ValueError, r"needs block_size in \(16, 128\) .*got block_size=64"),
        ({"num_speculative_tokens": 16}, ValueError, "at most 16 query tokens per decode"),
        ({"dtype": torch.float32}, TypeError, "the ascend MLA provider needs dtype in"),
    ],
)
def test_unsupported_spec_is_refused_in_plan(stand_in, host_ascend_mla, change, error, message):
    spec = dataclasses.replace(_case("decode_only").spec, **change)
    with pytest.raises(error, match=message):
        plan([0, 1], [5], [[1]], [5], 1, spec, provider=host_ascend_mla)


def test_interleaved_cache_views_are_refused(stand_in, host_ascend_mla) -> None:
    spec: MLASpec = _case("decode_only").spec
    cache = split_latent_cache(torch.zeros(2, 128, 576, dtype=spec.dtype), spec)
    step = plan([0, 1], [5], [[1]], [-1], 1, spec, provider=host_ascend_mla)
    q = torch.zeros(1, spec.num_heads, 512, dtype=spec.dtype)
    with pytest.raises(ValueError, match=r"needs contiguous cache planes .*got cache\.kv_c"):
        mla_decode(q, torch.zeros(1, spec.num_heads, 64, dtype=spec.dtype), cache, step, q.clone())


@pytest.mark.parametrize(
    ("provider", "case_name", "violation"),
    [
        ("CumulativeDecodeKvLengths", "decode_only", None),
        ("CausalMaskForSingleTokens", "decode_only", "one query token per request takes"),
        ("SpecDecodeWithoutMask", "spec_decoding", "several query tokens per request takes"),
        ("InterleavedCacheViews", "decode_only", "key must be contiguous"),
        ("AbsorbedScale", "prefill_cache_hit", None),
        ("RopeAsQuery", "spec_decoding", None),
        ("TopLeftCausalPrefill", "prefill_no_cache", "TND MLA takes sparse_mode 0 or 3"),
    ],
)
def test_faulty_provider_is_caught(stand_in, provider: str, case_name: str, violation) -> None:
    name = f"ascend-mla-faulty-{provider}"
    register_provider(name, f"{FAULTY}:{provider}", family="mla")
    batch = build_mla_batch(_case(case_name))
    if violation is not None:
        with pytest.raises(SchemaViolation, match=violation):
            run_mla_provider(batch, name)
        return
    outcome = run_mla_provider(batch, name)
    limit = 10 * MLA_TOLERANCE[batch.case.dtype]
    assert any(not error <= limit for error in _errors(outcome, batch))  # NaN counts as missed


def test_the_faulty_cases_pass_when_run_correctly(stand_in, host_ascend_mla) -> None:
    """The faulty-provider cases above fail because of the fault, not the harness."""
    for case_name in ("decode_only", "spec_decoding", "prefill_cache_hit", "prefill_no_cache"):
        batch = build_mla_batch(_case(case_name))
        outcome = run_mla_provider(batch, host_ascend_mla)
        assert max(_errors(outcome, batch)) < MLA_TOLERANCE[batch.case.dtype]
