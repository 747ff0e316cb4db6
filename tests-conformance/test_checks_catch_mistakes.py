"""The conformance checks fail on wrong calls: each mistake here must be caught.

Two kinds: a valid recorded call replayed with one thing changed (the schema and
documented-value checks must reject it), and providers with one deliberate
mistake run end to end (a ``SchemaViolation``, or outputs that miss the dense
reference).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from ascend_cases import (
    CASES,
    DTYPE_TOLERANCE,
    build_batch,
    dense_reference,
    max_error,
    run_provider,
)
from schema_stand_in import NotModeled
from torch_npu_schemas import SchemaViolation
from verify_step_cases import gqa_verify_batch

from npu_attention import register_provider

FAULTY = "faulty_ascend_providers"


def _case(name: str):
    return next(case for case in CASES if case.name == name)


def _recorded_call(stand_in, case_name: str, op: str) -> dict:
    register_provider("ascend-recorded", "ascend_cases:HostAscendProvider")
    run_provider(build_batch(_case(case_name)), "ascend-recorded")
    (call,) = stand_in.log.of(op)
    return dict(call.arguments)


def _fia_call(stand_in) -> dict:
    arguments = _recorded_call(stand_in, "chunked_prefill", "npu_fused_infer_attention_score.out")
    stand_in.npu_fused_infer_attention_score.out(**arguments)  # the baseline passes
    return arguments


def test_unknown_operator_is_caught(stand_in) -> None:
    with pytest.raises(SchemaViolation, match="no operator 'npu_paged_attention_v9'"):
        stand_in.npu_paged_attention_v9(torch.zeros(1))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"actual_seq_lengths_q": [1]}, "unexpected keyword argument 'actual_seq_lengths_q'"),
        ({"sparse_mode": 7}, "sparse_mode=7 is not documented"),
        ({"input_layout": "TDN"}, "input_layout 'TDN' is not one of the documented"),
        ({"actual_seq_lengths": None}, "TND needs actual_seq_lengths"),
        ({"num_heads": 8.0}, "argument 'num_heads' must be int"),
        ({"block_size": 64}, "block_size must be a multiple of 128"),
        ({"out": "not a list"}, "out must be a list of 2 tensors"),
    ],
)
def test_changed_fused_attention_call_is_caught(stand_in, change: dict, message: str) -> None:
    arguments = _fia_call(stand_in)
    arguments.update(change)
    with pytest.raises(SchemaViolation, match=message):
        stand_in.npu_fused_infer_attention_score.out(**arguments)


def test_tensor_for_host_list_is_caught(stand_in) -> None:
    arguments = _fia_call(stand_in)
    arguments["actual_seq_lengths_kv"] = torch.tensor(arguments["actual_seq_lengths_kv"])
    with pytest.raises(SchemaViolation, match="'actual_seq_lengths_kv' must be"):
        stand_in.npu_fused_infer_attention_score.out(**arguments)


def test_missing_and_extra_positional_arguments_are_caught(stand_in) -> None:
    arguments = _fia_call(stand_in)
    query, key, value = arguments.pop("query"), arguments.pop("key"), arguments.pop("value")
    with pytest.raises(SchemaViolation, match="missing a required argument: 'value'"):
        stand_in.npu_fused_infer_attention_score.out(query, key, **arguments)
    num_heads = arguments.pop("num_heads")
    with pytest.raises(SchemaViolation, match="too many positional arguments"):
        stand_in.npu_fused_infer_attention_score.out(query, key, value, num_heads, **arguments)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cache_mode": "ND"}, "cache_mode='ND' is not documented"),
        ({"slot_mapping": "negative"}, "slot_mapping values must lie in"),
        ({"slot_mapping": "float"}, "slot_mapping must be int32/int64"),
        ({"compress_len": None}, "unexpected keyword argument 'compress_len'"),
    ],
)
def test_changed_kv_write_call_is_caught(stand_in, change: dict, message: str) -> None:
    arguments = _recorded_call(stand_in, "prefill_no_cache", "npu_scatter_pa_kv_cache")
    stand_in.npu_scatter_pa_kv_cache(**arguments)  # the baseline passes
    slots = arguments["slot_mapping"]
    replacements = {"negative": torch.full_like(slots, -1), "float": slots.double()}
    for name, value in change.items():
        arguments[name] = replacements.get(value, value) if name == "slot_mapping" else value
    with pytest.raises(SchemaViolation, match=message):
        stand_in.npu_scatter_pa_kv_cache(**arguments)


def test_changed_fusion_attention_call_is_caught(stand_in) -> None:
    arguments = _recorded_call(stand_in, "causal_no_cache", "npu_fusion_attention")
    stand_in.npu_fusion_attention(**arguments)  # the baseline passes
    lengths = arguments["actual_seq_qlen"]
    per_request = [lengths[0], *(b - a for a, b in itertools.pairwise(lengths))]
    with pytest.raises(SchemaViolation, match="actual_seq_qlen are cumulative ends"):
        stand_in.npu_fusion_attention(**{**arguments, "actual_seq_qlen": per_request})
    with pytest.raises(SchemaViolation, match="unexpected keyword argument 'pre_tokens'"):
        stand_in.npu_fusion_attention(**{**arguments, "pre_tokens": 3})


def test_unmodelled_mode_is_not_silently_accepted(stand_in) -> None:
    arguments = _fia_call(stand_in)
    with pytest.raises(NotModeled):
        stand_in.npu_fused_infer_attention_score.out(**{**arguments, "input_layout": "BSH"})


@pytest.mark.parametrize(
    ("provider", "case_name", "violation"),
    [
        ("PerRequestQueryLengths", "chunked_prefill", "actual_seq_lengths"),
        ("CumulativeKvLengths", "decode_only", "actual_seq_lengths_kv are per-request lengths"),
        ("TopLeftCausal", "prefill_cache_hit", None),
        ("WindowOffByOne", "chunked_prefill_window", None),
        ("LowerTriangularMask", "prefill_no_cache", "True strictly above the diagonal"),
        ("UndocumentedSparseMode", "spec_decoding", "sparse_mode=7 is not documented"),
        ("PaddingSlotsPassed", "decode_only", "slot_mapping values must lie in"),
        ("PagedNzCacheMode", "prefill_no_cache", "ND caches need cache_mode='Norm'"),
    ],
)
def test_faulty_provider_is_caught(stand_in, provider: str, case_name: str, violation) -> None:
    name = f"ascend-faulty-{provider}"
    register_provider(name, f"{FAULTY}:{provider}")
    batch = build_batch(_case(case_name))
    if violation is not None:
        with pytest.raises(SchemaViolation, match=violation):
            run_provider(batch, name)
        return
    out = run_provider(batch, name).out[: sum(batch.case.query_lens)]
    assert max_error(out, dense_reference(batch)) > 10 * DTYPE_TOLERANCE[batch.case.dtype]


def test_a_correct_run_is_within_tolerance_for_the_same_cases(stand_in) -> None:
    """The faulty-provider cases above fail because of the fault, not the harness."""
    register_provider("ascend-recorded", "ascend_cases:HostAscendProvider")
    for case_name in ("decode_only", "prefill_cache_hit", "chunked_prefill_window"):
        batch = build_batch(_case(case_name))
        out = run_provider(batch, "ascend-recorded").out[: sum(batch.case.query_lens)]
        assert max_error(out, dense_reference(batch)) < DTYPE_TOLERANCE[batch.case.dtype]


def _verify_call(stand_in) -> dict:
    """The fused-op call of a padded verify step (``verify_step_cases``)."""
    register_provider("ascend-recorded", "ascend_cases:HostAscendProvider")
    run_provider(gqa_verify_batch(), "ascend-recorded")
    (call,) = stand_in.log.of("npu_fused_infer_attention_score.out")
    arguments = dict(call.arguments)
    stand_in.npu_fused_infer_attention_score.out(**arguments)  # the baseline passes
    return arguments


def _per_request(ends: list[int]) -> list[int]:
    return [ends[0], *(b - a for a, b in itertools.pairwise(ends))]


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        # query lengths [3, 3, ...] where TND wants cumulative ends [3, 6, ...]
        ("per_request_query_lengths", r"actual_seq_lengths\[-1\] must equal T"),
        # vLLM's padding unchanged: padding requests without tokens, padded rows after
        ("padding_requests_without_tokens", r"actual_seq_lengths\[-1\] must equal T"),
        ("cumulative_kv_lengths", "actual_seq_lengths_kv are per-request lengths"),
        ("causal_without_mask", "sparse_mode=3 needs the 2048x2048 atten_mask"),
        ("keep_matrix_mask", "True strictly above the diagonal"),
    ],
)
def test_changed_verify_step_call_is_caught(stand_in, mistake: str, message: str) -> None:
    arguments = _verify_call(stand_in)
    ends, kv_lens = arguments["actual_seq_lengths"], arguments["actual_seq_lengths_kv"]
    real = len(ends) - 2  # verify_step_cases.PADDING_REQUESTS
    changes = {
        "per_request_query_lengths": {"actual_seq_lengths": _per_request(ends)},
        "padding_requests_without_tokens": {
            "actual_seq_lengths": ends[:real] + [ends[real - 1]] * (len(ends) - real),
            "actual_seq_lengths_kv": kv_lens[:real] + [0] * (len(ends) - real),
        },
        "cumulative_kv_lengths": {
            "actual_seq_lengths_kv": torch.tensor(kv_lens).cumsum(0).tolist()
        },
        "causal_without_mask": {"atten_mask": None},
        "keep_matrix_mask": {"atten_mask": ~arguments["atten_mask"]},
    }
    with pytest.raises(SchemaViolation, match=message):
        stand_in.npu_fused_infer_attention_score.out(**{**arguments, **changes[mistake]})


@pytest.mark.parametrize("provider", ["SpecDecodeWithoutMask", "TopLeftCausal"])
def test_faulty_verify_step_provider_misses_the_reference(stand_in, provider: str) -> None:
    """Masks the op accepts but that are wrong for a verify step: no mask (each draft
    token sees the later drafts) and top-left causal (drafts lose their context)."""
    name = f"ascend-faulty-{provider}"
    register_provider(name, f"{FAULTY}:{provider}")
    batch = gqa_verify_batch()
    out = run_provider(batch, name).out[: sum(batch.case.query_lens)]
    assert max_error(out, dense_reference(batch)) > 10 * DTYPE_TOLERANCE[batch.case.dtype]
    register_provider("ascend-recorded", "ascend_cases:HostAscendProvider")
    correct = run_provider(batch, "ascend-recorded").out[: sum(batch.case.query_lens)]
    assert max_error(correct, dense_reference(batch)) < DTYPE_TOLERANCE[batch.case.dtype]
