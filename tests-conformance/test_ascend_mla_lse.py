"""The ascend MLA provider's log-sum-exp (``mla_decode(..., lse=)``): decode context
parallelism's plans through ATB's MultiLatentAttention.

Every row of a DCP step is its own one-token request (``plan_context`` with an
``MLASpec``) whose KV length is the number of the rank's latents up to the row's
position, 0 for graph padding. Each rank's part runs through the ascend MLA provider
against the stand-in ``torch_npu`` (the ATB call bound to the header declaration and
the registered schema, checked against the documented values, computed on CPU with
the LSE rounded to the query dtype) and through the reference MLA provider; the
ranks' parts merged by LSE must equal unsharded attention computed in float64.
Wrong calls and providers must be caught.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch
from ascend_mla_cases import LATENT, ROPE
from ascend_mla_dcp_cases import BATCHES, DcpBatch, mla_spec
from torch_npu_schemas import SchemaViolation

from npu_attention import merge_attention_states, plan_context, register_provider
from npu_attention.mla import allocate_latent_cache, mla_decode, mla_finish_decode

ASCEND_MLA_TARGET = "npu_attention.providers.ascend_mla:AscendMLAProvider"
FAULTY = "faulty_ascend_mla_providers"
ATB_CALL = "atb.npu_multi_head_latent_attention.lse_out"
ATB_WORKSPACE = "atb._npu_multi_head_latent_attention_get_workspace.lse"
# (gathered heads, block size, dtype, DCP size, interleave): head counts ATB documents
# (8 to 128) and one it pads (20 -> 32)
LAYOUTS = [
    (8, 128, torch.bfloat16, 2, 1),
    (16, 16, torch.float16, 2, 4),
    (20, 16, torch.bfloat16, 1, 1),
    (64, 128, torch.float16, 4, 1),
    (128, 16, torch.bfloat16, 2, 16),
]
# |a - e| <= atol + rtol |e|: outputs and merged results against float64 (fp16/bf16
# inputs and outputs); the ascend LSE is rounded to the query dtype by the op
TOLERANCE = {
    torch.float16: dict(atol=2e-2, rtol=2e-2),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
}
LSE_TOLERANCE = {  # half an ulp of the LSE's dtype, relative; absolute near 0
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
}


@pytest.fixture
def host_ascend_mla():
    register_provider("ascend", "ascend_mla_cases:HostAscendMLAProvider", family="mla")
    yield "ascend"
    register_provider("ascend", ASCEND_MLA_TARGET, family="mla")


def _merged(parts) -> tuple[torch.Tensor, torch.Tensor]:
    outputs = torch.stack([out.float() for out, _ in parts])
    return merge_attention_states(outputs, torch.stack([lse for _, lse in parts]))


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda x: f"N{x[0]}-bs{x[1]}-{str(x[2])[6:]}-dcp{x[3]}-i{x[4]}"
)
def test_dcp_parts_match_reference_and_merge_to_oracle(
    stand_in, host_ascend_mla, batch_name, layout
) -> None:
    heads, block_size, dtype, size, interleave = layout
    batch = DcpBatch(mla_spec(heads, block_size, dtype), *BATCHES[batch_name])
    real = len(batch.position)
    parts = []
    for rank in range(size):
        out, lse = batch.rank_part(host_ascend_mla, size, rank, interleave)
        ref_out, ref_lse = batch.rank_part("reference", size, rank, interleave)
        torch.testing.assert_close(lse, ref_lse, **LSE_TOLERANCE[dtype])  # -inf rows too
        torch.testing.assert_close(out.double(), ref_out.double(), **TOLERANCE[dtype])
        assert torch.isneginf(lse[real:]).all() and (out[real:] == 0).all(), "padding rows"
        parts.append((out, lse))
    out, lse = _merged(parts)
    want_out, want_lse = batch.oracle()
    torch.testing.assert_close(out[:real].double(), want_out, **TOLERANCE[dtype])
    torch.testing.assert_close(lse[:real].double(), want_lse, **LSE_TOLERANCE[dtype])
    calls = stand_in.log.of(ATB_CALL)
    assert len(calls) == size and len(stand_in.log.of(ATB_WORKSPACE)) == 1
    assert not stand_in.log.of("npu_fused_infer_attention_score_v2.out")


def test_atb_call_records_the_documented_arguments(stand_in, host_ascend_mla) -> None:
    batch = DcpBatch(mla_spec(20, 16, torch.bfloat16), *BATCHES["decode_only"])
    batch.rank_part(host_ascend_mla, 2, 1, 1)
    (call,) = stand_in.log.of(ATB_CALL)
    a = call.arguments
    assert a["return_lse"] is True and a["calc_type"] == "calc_type_ring"
    assert a["head_num"] == 32 and a["kv_headnum"] == 1  # 20 heads padded to 32
    # rank 1 of 2 keeps odd positions: rows at positions 0, 1, 150, 7, then padding
    assert a["context_lens"] == [0, 1, 75, 4, 0, 0]
    assert a["ctkv"].shape == (batch.num_blocks, 16, 1, 512)
    assert a["k_rope"].shape == (batch.num_blocks, 16, 1, 64)
    assert a["output"].shape == (6, 32, 512) and a["lse"].shape == (6, 32, 1)
    assert a["lse"].dtype == torch.bfloat16 and a["workspace"] is not None
    assert a["mask"] is None and a["mask_type"] is None and a["qseqlen"] is None


def test_decode_without_lse_stays_on_the_fused_op(stand_in, host_ascend_mla) -> None:
    batch = DcpBatch(mla_spec(32, 16, torch.bfloat16), *BATCHES["decode_only"])
    step = batch.rank_plan(host_ascend_mla, 2, 0, 1)
    out = torch.zeros_like(batch.q_latent)
    mla_decode(batch.q_latent, batch.q_rope, batch.rank_cache(2, 0, 1), step, out)
    assert stand_in.log.of("npu_fused_infer_attention_score_v2.out")
    assert not stand_in.log.of(ATB_CALL)


@pytest.mark.parametrize(
    ("cu_seqlens_q", "seq_lens", "message"),
    [
        ([0, 3], [8], r"got decode requests of \[3\] query tokens"),  # a verify step
        ([0, 1, 1], [8, 4], r"got decode requests of \[0, 1\] query tokens"),  # padding
    ],
)
def test_lse_of_other_than_one_token_decodes_is_refused(
    stand_in, host_ascend_mla, cu_seqlens_q, seq_lens, message
) -> None:
    from npu_attention import plan

    spec = dataclasses.replace(mla_spec(32, 16, torch.bfloat16), num_speculative_tokens=2)
    cache = allocate_latent_cache(4, spec)
    rows = cu_seqlens_q[-1]
    tables = [[1]] * len(seq_lens)
    step = plan(cu_seqlens_q, seq_lens, tables, [5, 6, 7][:rows], len(seq_lens), spec,
                provider=host_ascend_mla)  # fmt: skip
    q = torch.zeros(rows, 32, LATENT, dtype=spec.dtype)
    with pytest.raises(ValueError, match=message):
        mla_decode(q, q[..., :ROPE].clone(), cache, step, q.clone(), lse=torch.zeros(rows, 32))


# ---------------------------------------------------------------- wrong calls are caught


def _recorded(stand_in, host_ascend_mla) -> dict:
    batch = DcpBatch(mla_spec(32, 16, torch.bfloat16), *BATCHES["chunked_prefill"])
    batch.rank_part(host_ascend_mla, 2, 0, 1)
    (call,) = stand_in.log.of(ATB_CALL)
    return dict(call.arguments)


def _replay(stand_in, arguments: dict) -> None:
    """Call the ATB op with ``arguments`` (declared names): positional ones by position,
    as the header's and the registered names differ (``head_num`` / ``q_headnum``)."""
    (overload,) = [o for o in stand_in.atb.npu_multi_head_latent_attention.overloads
                   if o.name == ATB_CALL]  # fmt: skip
    params = overload.declared.signature.parameters.values()
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    args = [arguments[name] for name in positional]
    kwargs = {k: v for k, v in arguments.items() if k not in positional}
    stand_in.atb.npu_multi_head_latent_attention(*args, **kwargs)


def test_recorded_atb_call_passes_when_replayed(stand_in, host_ascend_mla) -> None:
    _replay(stand_in, _recorded(stand_in, host_ascend_mla))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"calc_type": None}, "needs return_lse=True with calc_type='calc_type_ring'"),
        ({"return_lse": False}, "needs return_lse=True with calc_type='calc_type_ring'"),
        ({"mask_type": "mask_type_spec"}, "calc_type_ring takes no mask"),
        ({"head_num": 48}, r"head_num must be one of \(8, 16, 32, 64, 128\), got 48"),
        ({"kv_headnum": 2}, "kv_headnum must be 1"),
        ({"qk_scale": 1.5}, r"qk_scale must lie in \(0, 1\]"),
        ({"context_lens": "tensor"}, "no overload takes this call"),
        ({"lse": "float32"}, r"lse must be a contiguous \(22, 32, 1\) torch.bfloat16"),
        ({"lse": "2-D"}, r"lse must be a contiguous \(22, 32, 1\)"),
        ({"ctkv": "plane"}, r"ctkv must be \[num_blocks, block_size, 1, 512\]"),
        ({"context_lens": "cumulative"}, "context_lens are per-request KV lengths"),
        ({"context_lens": "one short"}, "one query token per request"),
        ({"block_tables": "int64"}, "block_tables must be int32"),
    ],
)
def test_wrong_atb_calls_are_caught(stand_in, host_ascend_mla, change, message) -> None:
    arguments = _recorded(stand_in, host_ascend_mla)
    (name, value), = change.items()  # fmt: skip
    lse, lens = arguments["lse"], arguments["context_lens"]
    value = (
        {
            "float32": lse.float(),
            "2-D": lse[..., 0],
            "plane": arguments["ctkv"][:, :, 0],
            "tensor": torch.tensor(lens, dtype=torch.int32),
            "cumulative": np.cumsum(lens).tolist(),
            "one short": lens[:-1],
            "int64": arguments["block_tables"].long(),
        }.get(value, value)
        if isinstance(value, str) and name != "mask_type"
        else value
    )
    arguments[name] = value
    with pytest.raises(SchemaViolation, match=message):
        _replay(stand_in, arguments)


def test_header_names_by_keyword_are_caught(stand_in, host_ascend_mla) -> None:
    """``head_num`` is the header's C++ name; torch binds the registered ``q_headnum``."""
    arguments = _recorded(stand_in, host_ascend_mla)
    with pytest.raises(SchemaViolation, match="no overload takes this call"):
        stand_in.atb.npu_multi_head_latent_attention(**arguments)
    with pytest.raises(SchemaViolation, match=r"has no ATB operator atb\.npu_mla_decode_lse"):
        stand_in.atb.npu_mla_decode_lse(arguments["q_nope"])


@pytest.mark.parametrize(
    ("provider", "violation"),
    [
        ("LseKeylessRowsUnmasked", None),
        ("LseUnpaddedHeads", r"head_num must be one of \(8, 16, 32, 64, 128\), got 20"),
        ("LseWithoutRingCalcType", "needs return_lse=True with calc_type='calc_type_ring'"),
        ("LseInFloat32", r"lse must be a contiguous \(\d+, 32, 1\) torch.bfloat16"),
    ],
)
def test_faulty_lse_provider_is_caught(stand_in, provider: str, violation) -> None:
    name = f"ascend-mla-faulty-{provider}"
    register_provider(name, f"{FAULTY}:{provider}", family="mla")
    heads = 20 if provider == "LseUnpaddedHeads" else 32
    batch = DcpBatch(mla_spec(heads, 16, torch.bfloat16), *BATCHES["decode_only"])
    if violation is not None:
        with pytest.raises(SchemaViolation, match=violation):
            batch.rank_part(name, 2, 0, 1)
        return
    _, lse = batch.rank_part(name, 2, 0, 1)
    _, ref_lse = batch.rank_part("reference", 2, 0, 1)
    assert not torch.allclose(lse, ref_lse, **LSE_TOLERANCE[torch.bfloat16], equal_nan=True)


# ---------------------------------------------------------------- graph task update


def test_task_update_reissues_the_atb_call_with_new_lengths(stand_in, host_ascend_mla) -> None:
    """The ATB call as a captured task (``mla_decode(..., finish=False)``), its finish
    (copies, the LSE's dtype, masking of KV-length-0 rows) after the task in the graph:
    a task update re-issues the ATB call alone, with the next step's per-request KV
    lengths into the same fixed buffers (the simulator refuses any other device work in
    an update). This reads the op's own ``output`` / ``lse`` buffers; the finish replays
    too, on the captured plan's lengths (this test's plans are not at fixed addresses)."""
    npu = stand_in.npu
    batch = DcpBatch(mla_spec(32, 16, torch.bfloat16), *BATCHES["chunked_prefill"])
    cache = batch.rank_cache(2, 0, 1)
    step1 = batch.rank_plan(host_ascend_mla, 2, 0, 1)
    lengths = np.maximum(np.asarray(step1.seq_lens_host) - 3, 0)  # another step's lengths
    rows = batch.q_latent.shape[0]

    def plan_of(lens, provider):
        tables = step1.block_tables
        return plan_context(np.arange(rows + 1), lens, tables, rows, batch.spec, provider=provider)

    out = torch.zeros_like(batch.q_latent)
    lse = torch.zeros(rows, batch.spec.num_heads)

    def decode(step_plan) -> None:
        mla_decode(batch.q_latent, batch.q_rope, cache, step_plan, out, lse=lse, finish=False)

    graph, capture_stream, event = npu.NPUGraph(), npu.Stream(), npu.ExternalEvent()
    with npu.graph(graph, stream=capture_stream):
        stream = npu.current_stream()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        decode(step1)
        handle = npu.graph_task_group_end(stream)
        mla_finish_decode(batch.q_latent, step1, out, lse=lse)
    (result, row_lse), = step1.provider._scratch.values()  # fmt: skip

    def check(lens) -> None:
        ref_out = torch.zeros_like(out)
        ref_lse = torch.zeros_like(lse)
        reference = plan_of(lens, "reference")
        mla_decode(batch.q_latent, batch.q_rope, cache, reference, ref_out, lse=ref_lse)
        keyed = torch.as_tensor(np.asarray(lens) > 0)
        got_lse = row_lse[keyed, :, 0].float()
        torch.testing.assert_close(got_lse, ref_lse[keyed], **LSE_TOLERANCE[torch.bfloat16])
        torch.testing.assert_close(
            result[keyed].double(), ref_out[keyed].double(), **TOLERANCE[torch.bfloat16]
        )

    event.record(npu.Stream())  # no update: the captured lengths are released
    graph.replay()
    check(step1.seq_lens_host)
    event.record(npu.Stream())
    graph.replay()  # no update: the captured lengths are stale for the next step
    with pytest.raises(AssertionError):
        check(lengths.tolist())
    update_stream, step2 = npu.Stream(), plan_of(lengths, host_ascend_mla)
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        decode(step2)
        npu.graph_task_update_end(update_stream)
        event.record(update_stream)
    graph.replay()
    check(lengths.tolist())
    (call,) = [c for c in stand_in.log.of(ATB_CALL)][-1:]
    assert call.arguments["context_lens"] == lengths.tolist()
    assert call.arguments["output"] is result and call.arguments["lse"] is row_lse
