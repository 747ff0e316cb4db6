"""The verify step of speculative decoding through the ascend providers, as the bridge
plans it for a FULL graph: ``1 + k`` query tokens per request, padded to a captured
size by padding requests of ``1 + k`` tokens on the null block (``verify_step_cases``).

Every torch_npu call is bound to its schema and checked against the documented
values by the stand-in; the tests pin the spec-decode arguments the op documents
for several query tokens per request: ``sparse_mode=3`` (bottom-right causal: draft
token ``t`` sees the context and drafts up to ``t``) with the 2048x2048 mask,
cumulative query ends in multiples of ``1 + k`` up to the padded token count,
per-request KV lengths, and the null block for padding requests. Real rows must
match float64 attention; the KV write gets only the real tokens' slots.
"""

from __future__ import annotations

import pytest
import torch
from ascend_cases import DTYPE_TOLERANCE, dense_reference, max_error, run_provider
from ascend_mla_cases import MLA_TOLERANCE, mla_reference, run_mla_provider
from schema_stand_in import MASK_SIZE
from torch_npu_schemas import SchemaViolation
from verify_step_cases import NULL_BLOCK, PADDING_REQUESTS, gqa_verify_batch, mla_verify_batch

from npu_attention import register_provider

ASCEND_MLA_TARGET = "npu_attention.providers.ascend_mla:AscendMLAProvider"
CAUSAL_MASK = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1)


@pytest.fixture
def host_ascend_mla():
    register_provider("ascend", "ascend_mla_cases:HostAscendMLAProvider", family="mla")
    yield "ascend"
    register_provider("ascend", ASCEND_MLA_TARGET, family="mla")


def test_gqa_verify_step_calls_the_fused_op_as_documented(stand_in) -> None:
    register_provider("ascend-verify", "ascend_cases:HostAscendProvider")
    batch = gqa_verify_batch()
    case = batch.case
    outcome = run_provider(batch, "ascend-verify")

    (call,) = stand_in.log.of("npu_fused_infer_attention_score.out")
    arguments = call.arguments
    assert arguments["input_layout"] == "TND"
    assert arguments["sparse_mode"] == 3
    assert torch.equal(arguments["atten_mask"].cpu(), CAUSAL_MASK)
    q = 1 + case.num_speculative_tokens
    num_reqs = len(case.query_lens) + PADDING_REQUESTS
    assert arguments["actual_seq_lengths"] == [q * (i + 1) for i in range(num_reqs)]
    real_kv = [c + n for c, n in zip(case.context_lens, case.query_lens)]
    assert arguments["actual_seq_lengths_kv"] == [*real_kv, *[q] * PADDING_REQUESTS]
    assert bool((arguments["block_table"][-PADDING_REQUESTS:] == NULL_BLOCK).all())
    assert arguments["query"].shape[0] == q * num_reqs

    (write,) = stand_in.log.of("npu_scatter_pa_kv_cache")
    real = sum(case.query_lens)
    assert torch.equal(write.arguments["slot_mapping"], batch.slot_mapping[:real])
    assert max_error(outcome.out[:real], dense_reference(batch)) < DTYPE_TOLERANCE[case.dtype]


def test_mla_verify_step_calls_the_v2_op_as_documented(stand_in, host_ascend_mla) -> None:
    batch = mla_verify_batch()
    case = batch.case
    outcome = run_mla_provider(batch, host_ascend_mla)

    (call,) = stand_in.log.of("npu_fused_infer_attention_score_v2.out")
    arguments = call.arguments
    assert arguments["input_layout"] == "TND"
    assert arguments["sparse_mode"] == 3
    assert torch.equal(arguments["atten_mask"].cpu(), CAUSAL_MASK)
    q = 1 + case.num_speculative_tokens
    num_reqs = len(case.query_lens) + PADDING_REQUESTS
    assert arguments["actual_seq_qlen"] == [q * (i + 1) for i in range(num_reqs)]
    real_kv = [c + n for c, n in zip(case.context_lens, case.query_lens)]
    assert arguments["actual_seq_kvlen"] == [*real_kv, *[q] * PADDING_REQUESTS]
    assert bool((arguments["block_table"][-PADDING_REQUESTS:] == NULL_BLOCK).all())

    (write,) = stand_in.log.of("npu_scatter_pa_kv_cache")
    real = sum(case.query_lens)
    assert torch.equal(write.arguments["slot_mapping"], batch.slot_mapping[:real])
    decode, _ = mla_reference(batch)
    assert max_error(outcome.decode_out[:real], decode) < MLA_TOLERANCE[case.dtype]


def test_padding_requests_without_tokens_break_the_documented_mla_call(
    stand_in, host_ascend_mla
) -> None:
    """vLLM's own padding (requests of 0 query tokens and 0 keys, the padded tokens after
    the last request) handed to the op unchanged: the v2 op documents 1 to 16 query
    tokens per request, which is why the bridge gives padding requests ``1 + k``."""
    with pytest.raises(SchemaViolation, match="MLA takes 1 to 16 query tokens per request"):
        run_mla_provider(mla_verify_batch(padding_len=0), host_ascend_mla)
