"""The ascend provider's log-sum-exp calls (``run(..., lse=)``, context parallelism).

The paged call passes ``softmax_lse_flag=True`` with ``out=[attention_out,
softmax_lse]``, ``softmax_lse`` ``[T, N, 1]`` float32 as torch_npu documents for
``TND``; the no-cache call derives the LSE from ``softmax_max`` and ``softmax_sum``.
Both are bound to torch_npu 2.14.0's schemas by the stand-in and compared with the
reference provider's LSE (float32 sums of exponentials of the same fp16/bf16
inputs: within ``LSE_TOLERANCE``). Wrong LSE calls must be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ascend_cases import CASES, DTYPE_TOLERANCE, Batch, Case, build_batch, max_error
from torch_npu_schemas import SchemaViolation

from npu_attention import plan, plan_context, register_provider, run

ASCEND_TARGET = "npu_attention.providers.ascend:AscendProvider"
LSE_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture
def host_ascend() -> str:
    register_provider("ascend", "ascend_cases:HostAscendProvider")
    yield "ascend"
    register_provider("ascend", ASCEND_TARGET)


def _run_with_lse(batch: Batch, provider: str) -> tuple[torch.Tensor, torch.Tensor]:
    case, with_cache = batch.case, batch.case.with_cache
    key_cache = batch.key_cache.clone() if with_cache else None
    value_cache = batch.value_cache.clone() if with_cache else None
    step = plan(
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.block_tables if with_cache else None,
        batch.slot_mapping if with_cache else None,
        case.num_decodes,
        case.spec,
        provider=provider,
    )
    out = torch.zeros_like(batch.query)
    lse = torch.full((batch.query.shape[0], case.num_heads), 5.0)
    run(batch.query, batch.key, batch.value, key_cache, value_cache, step, out, lse=lse)
    return out, lse


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_lse_matches_reference_provider(case: Case, stand_in, host_ascend) -> None:
    batch = build_batch(case)
    out, lse = _run_with_lse(batch, host_ascend)
    ref_out, ref_lse = _run_with_lse(batch, "reference")
    n = sum(case.query_lens)
    torch.testing.assert_close(lse[:n], ref_lse[:n], **LSE_TOLERANCE)
    assert (lse[n:] == 5.0).all(), "padding rows written"
    assert max_error(out[:n], ref_out[:n]) < DTYPE_TOLERANCE[case.dtype]
    if case.with_cache:
        (call,) = stand_in.log.of("npu_fused_infer_attention_score.out")
        assert call.arguments["softmax_lse_flag"] is True
        softmax_lse = call.arguments["out"][1]
        assert softmax_lse.shape == (n, case.num_heads, 1)
        assert softmax_lse.data_ptr() == lse.data_ptr(), "written in place, no copy"
    else:
        (call,) = stand_in.log.of("npu_fusion_attention")


def test_strided_lse_is_refused_before_anything_is_written(stand_in, host_ascend) -> None:
    """The fused op writes ``softmax_lse`` as a contiguous ``[T, N, 1]``; a strided
    ``lse`` would need a scratch and a copy inside the graph task, so it is refused
    before the KV write."""
    case = next(c for c in CASES if c.name == "chunked_prefill")
    batch = build_batch(case)
    step = plan(batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, batch.slot_mapping,
                case.num_decodes, case.spec, provider=host_ascend)  # fmt: skip
    wide = torch.full((batch.query.shape[0], case.num_heads, 2), 5.0)
    lse = wide[..., 0]  # rows strided by 2 * heads
    key_cache = batch.key_cache.clone()
    with pytest.raises(ValueError, match="contiguous lse"):
        run(batch.query, batch.key, batch.value, key_cache, batch.value_cache.clone(),
            step, torch.zeros_like(batch.query), lse=lse)  # fmt: skip
    assert torch.equal(key_cache, batch.key_cache)
    assert (wide == 5.0).all()


def test_plan_context_lse_with_an_empty_shard(stand_in, host_ascend) -> None:
    """A DCP rank's context attention: every row sees its request's cached keys only
    (``sparse_mode=0``, no mask); a request with no cached key gets -inf and zeros."""
    case = next(c for c in CASES if c.name == "chunked_prefill")
    batch = build_batch(case)
    context = list(case.context_lens)
    context[0] = 0
    results = {}
    for provider in (host_ascend, "reference"):
        step = plan_context(batch.cu_seqlens_q, context, batch.block_tables, case.num_decodes,
                            case.spec, provider=provider)  # fmt: skip
        out = torch.full_like(batch.query, float("nan"))
        lse = torch.full((batch.query.shape[0], case.num_heads), float("nan"))
        run(batch.query, None, None, batch.key_cache, batch.value_cache, step, out, lse=lse)
        results[provider] = (out, lse)
    (call,) = stand_in.log.of("npu_fused_infer_attention_score.out")
    assert call.arguments["sparse_mode"] == 0 and call.arguments["atten_mask"] is None
    assert call.arguments["actual_seq_lengths_kv"] == context
    n = sum(case.query_lens)
    (out, lse), (ref_out, ref_lse) = results[host_ascend], results["reference"]
    first = slice(0, case.query_lens[0])
    assert (lse[first] == float("-inf")).all() and (out[first] == 0).all()
    torch.testing.assert_close(lse[:n], ref_lse[:n], **LSE_TOLERANCE)
    assert max_error(out[:n], ref_out[:n]) < DTYPE_TOLERANCE[case.dtype]
    assert np.isnan(out[n:].float().numpy()).all()


def _lse_call(stand_in, host_ascend) -> dict:
    case = next(c for c in CASES if c.name == "decode_only")
    _run_with_lse(build_batch(case), host_ascend)
    (call,) = stand_in.log.of("npu_fused_infer_attention_score.out")
    arguments = dict(call.arguments)
    stand_in.npu_fused_infer_attention_score.out(**arguments)  # the baseline passes
    return arguments


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        ("flag_off", r"softmax_lse must be \(1,\) \(softmax_lse_flag=False\)"),
        ("lse_without_trailing_1", r"softmax_lse must be \(\d+, \d+, 1\)"),
        ("lse_heads_first", r"softmax_lse must be \(\d+, \d+, 1\)"),
        ("unused_lse_buffer", r"softmax_lse must be \(\d+, \d+, 1\) \(softmax_lse_flag=True\)"),
        ("flag_as_int", "argument 'softmax_lse_flag' must be bool"),
        ("lse_name_of_v2", "unexpected keyword argument 'return_softmax_lse'"),
    ],
)
def test_wrong_lse_call_is_caught(stand_in, host_ascend, mistake: str, message: str) -> None:
    """Deliberately wrong LSE calls: the flag off while a ``[T, N, 1]`` buffer waits,
    the LSE in another layout, the ``[1]`` placeholder with the flag on, a non-bool
    flag, and the v2 op's keyword on the v1 op."""
    arguments = _lse_call(stand_in, host_ascend)
    attention_out, softmax_lse = arguments["out"]
    t, heads = softmax_lse.shape[:2]
    if mistake == "flag_off":
        arguments["softmax_lse_flag"] = False
    elif mistake == "lse_without_trailing_1":
        arguments["out"] = [attention_out, torch.empty(t, heads)]
    elif mistake == "lse_heads_first":
        arguments["out"] = [attention_out, torch.empty(heads, t, 1)]
    elif mistake == "unused_lse_buffer":
        arguments["out"] = [attention_out, torch.empty(1)]
    elif mistake == "flag_as_int":
        arguments["softmax_lse_flag"] = 1
    else:
        arguments["return_softmax_lse"] = arguments.pop("softmax_lse_flag")
    with pytest.raises(SchemaViolation, match=message):
        stand_in.npu_fused_infer_attention_score.out(**arguments)
