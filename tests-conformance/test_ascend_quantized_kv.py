"""The ascend provider over an int8 KV cache (``int8_per_token_head``), on torch_npu's schemas.

Each case quantizes a batch's context into int8 pages with float32 scales per token and
KV head (vLLM's definition, laid out head-major as the fused op's antiquant mode 5 reads
them), then runs one layer through ``npu_attention`` with the ascend provider against
the stand-in torch_npu and with the reference provider on a copy of the same cache. The
outputs are compared with each other and with float64 attention over the dequantized
keys and values (a prefill without context attends over its own rows unquantized); the
int8 pages and scales the two providers write must be equal. Decodes go through the
fused op's own dequantization (``BNSD``, one query token, ``key_antiquant_mode=5``),
other states through a dequantized copy of their pages (the op's prompt branch takes no
antiquant with page attention). In a graph, a task update re-issues the decode with the
same scale tensors (static arguments) and the next step's lengths. Bad input is refused
naming what was expected and what came, with nothing written.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ascend_cases import (
    DTYPE_TOLERANCE,
    Batch,
    Case,
    build_batch,
    dense_reference,
    max_error,
)
from torch_npu_schemas import SchemaViolation

from npu_attention import BatchState, kv_quant, plan, register_provider, run

KIND = "int8_per_token_head"
ASCEND_TARGET = "npu_attention.providers.ascend:AscendProvider"
DECODE_OPS = {
    "npu_scatter_pa_kv_cache",
    "_npu_fused_infer_attention_score_get_max_workspace",
    "npu_fused_infer_attention_score.out",
}

CASES = (
    Case("prefill_no_cache", BatchState.PREFILL_NO_CACHE, (0, 0, 0), (5, 140, 9)),
    Case(
        "prefill_cache_hit",
        BatchState.PREFILL_CACHE_HIT,
        (131, 0, 40),
        (7, 12, 90),
        dtype=torch.bfloat16,
    ),
    Case(
        "decode_only",
        BatchState.DECODE_ONLY,
        (0, 129, 255, 17),
        (1, 1, 1, 1),
        num_decodes=4,
        padding=4,
    ),
    Case(
        "decode_head128_bf16",
        BatchState.DECODE_ONLY,
        (127, 128, 300),
        (1, 1, 1),
        num_decodes=3,
        head_size=128,
        num_kv_heads=8,
        dtype=torch.bfloat16,
    ),
    Case(
        "decode_head256_mqa",
        BatchState.DECODE_ONLY,
        (5, 383),
        (1, 1),
        num_decodes=2,
        head_size=256,
        num_kv_heads=1,
    ),
    Case(
        "spec_decoding",
        BatchState.SPEC_DECODING,
        (10, 300, 127),
        (3, 3, 3),
        num_decodes=3,
        num_speculative_tokens=2,
        head_size=128,
        num_kv_heads=8,
    ),
    Case(
        "chunked_prefill",
        BatchState.CHUNKED_PREFILL,
        (60, 200, 130, 0),
        (1, 1, 33, 20),
        num_decodes=2,
        padding=3,
        num_kv_heads=1,
    ),
    Case("non_causal_paged", BatchState.PREFILL_CACHE_HIT, (40, 0), (20, 30), causal=False),
)


def quantized_spec(case: Case):
    return dataclasses.replace(case.spec, kv_cache_dtype=KIND)


@dataclasses.dataclass
class QuantizedCache:
    """int8 pages and head-major float32 scales ``[num_blocks, block_size, kv_heads]``."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def clone(self) -> QuantizedCache:
        return QuantizedCache(*(_clone_layout(t) for t in dataclasses.astuple(self)))


def _clone_layout(tensor: torch.Tensor) -> torch.Tensor:
    copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    return copy.copy_(tensor)


def head_major(num_blocks: int, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """float32 ``[num_blocks, block_size, num_kv_heads]`` over ``(blocknum, N, blocksize)``."""
    return torch.zeros(num_blocks, num_kv_heads, block_size).permute(0, 2, 1)


def quantize_cache(batch: Batch) -> QuantizedCache:
    """The batch's context (already in its float caches) as int8 pages and scales."""
    num_blocks, block_size, kv_heads, head_size = batch.key_cache.shape
    sides = []
    for cache in (batch.key_cache, batch.value_cache):
        codes, scales = kv_quant.quantize_per_token_head(
            cache.reshape(-1, kv_heads, head_size), torch.int8
        )
        scale = head_major(num_blocks, block_size, kv_heads)
        scale.copy_(scales.view(num_blocks, block_size, kv_heads))
        sides.append((codes.view(num_blocks, block_size, kv_heads, head_size), scale))
    return QuantizedCache(sides[0][0], sides[1][0], sides[0][1], sides[1][1])


def dequantized_oracle(batch: Batch) -> torch.Tensor:
    """float64 attention over the keys and values the cache holds after the step."""
    case = batch.case
    if case.state is BatchState.PREFILL_NO_CACHE:
        return dense_reference(batch)  # own rows, unquantized
    roundtrip = [_roundtrip(k) for k in batch.full_keys], [_roundtrip(v) for v in batch.full_values]
    return dense_reference(
        dataclasses.replace(batch, full_keys=roundtrip[0], full_values=roundtrip[1])
    )


def _roundtrip(rows: torch.Tensor) -> torch.Tensor:
    codes, scales = kv_quant.quantize_per_token_head(rows, torch.int8)
    return kv_quant.dequantize(codes, scales.unsqueeze(-1)).double()


def run_quantized(
    batch: Batch, cache: QuantizedCache, provider: str, *, lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer over ``cache`` (written in place): the output, and the LSE if asked."""
    case = batch.case
    step = plan(
        batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, batch.slot_mapping,
        case.num_decodes, quantized_spec(case), provider=provider,
    )  # fmt: skip
    assert step.state is case.state, (step.state, case.state)
    out = torch.zeros_like(batch.query)
    rows_lse = torch.zeros(batch.query.shape[:2]) if lse else None
    run(
        batch.query, batch.key, batch.value, cache.key_cache, cache.value_cache, step, out,
        rows_lse, k_scale=cache.k_scale, v_scale=cache.v_scale,
    )  # fmt: skip
    return out, rows_lse


@pytest.fixture
def host_ascend():
    register_provider("ascend", "ascend_cases:HostAscendProvider")
    yield "ascend"
    register_provider("ascend", ASCEND_TARGET)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_matches_reference_provider_and_float64_oracle(case: Case, stand_in, host_ascend) -> None:
    batch = build_batch(case)
    cache = quantize_cache(batch)
    ascend_cache, reference_cache = cache.clone(), cache.clone()
    out, _ = run_quantized(batch, ascend_cache, host_ascend)
    expected, _ = run_quantized(batch, reference_cache, "reference")
    n, tolerance = sum(case.query_lens), DTYPE_TOLERANCE[case.dtype]

    assert max_error(out[:n], dequantized_oracle(batch)) < tolerance
    assert max_error(out[:n], expected[:n]) < tolerance
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows written"
    for name in ("key_cache", "value_cache", "k_scale", "v_scale"):
        assert torch.equal(getattr(ascend_cache, name), getattr(reference_cache, name)), name
    assert not torch.equal(ascend_cache.key_cache, cache.key_cache), "nothing was written"
    _check_calls(stand_in.log, case)


def _check_calls(log, case: Case) -> None:
    """Decodes: the fused op's own dequantization; other states: a dequantized copy."""
    writes = log.of("npu_scatter_pa_kv_cache")
    assert len(writes) == 1 and writes[0].arguments["key_cache"].dtype == torch.int8
    if case.state is BatchState.PREFILL_NO_CACHE:
        assert log.names() == {"npu_scatter_pa_kv_cache", "npu_fusion_attention"}
        return
    assert log.names() == DECODE_OPS
    (call,) = log.of("npu_fused_infer_attention_score.out")
    a = call.arguments
    if case.state is BatchState.DECODE_ONLY:
        assert (a["input_layout"], a["key"].dtype, a["sparse_mode"]) == ("BNSD", torch.int8, 0)
        assert a["key_antiquant_mode"] == a["value_antiquant_mode"] == 5
        blocks = a["key"].shape[0]
        assert a["key_antiquant_scale"].shape == (blocks, case.num_kv_heads, 128)
        assert a["actual_seq_lengths"] is None
    else:
        assert (a["input_layout"], a["key"].dtype) == ("TND", case.dtype)
        assert a["key_antiquant_scale"] is None


def test_decode_lse_matches_the_reference_provider(stand_in, host_ascend) -> None:
    case = next(c for c in CASES if c.name == "decode_only")
    batch = build_batch(case, seed=3)
    cache = quantize_cache(batch)
    out, lse = run_quantized(batch, cache.clone(), host_ascend, lse=True)
    expected, expected_lse = run_quantized(batch, cache.clone(), "reference", lse=True)
    n = sum(case.query_lens)
    assert max_error(out[:n], expected[:n]) < DTYPE_TOLERANCE[case.dtype]
    assert torch.allclose(lse[:n], expected_lse[:n], atol=1e-4, rtol=1e-5)
    (call,) = stand_in.log.of("npu_fused_infer_attention_score.out")
    assert call.arguments["softmax_lse_flag"] is True
    assert call.arguments["out"][1].shape == (n, case.num_heads, 1, 1)


# ---------------------------------------------------------------- graphs


class QuantizedSteps:
    """Decode steps over one int8 cache: step ``s`` appends one token per request."""

    # request 3 reaches its page's last row at step 3 (a page edge)
    case = Case(
        "graph_decode", BatchState.DECODE_ONLY, (0, 2, 125), (1, 1, 1), num_decodes=3,
        head_size=128, num_kv_heads=8, dtype=torch.bfloat16,
    )  # fmt: skip

    def __init__(self) -> None:
        register_provider("ascend-graph", "ascend_cases:HostAscendProvider")
        self.batch = build_batch(self.case)
        self.cache = quantize_cache(self.batch)
        self.query = self.batch.query.clone()
        self.out = torch.zeros_like(self.query)
        self.spec = quantized_spec(self.case)

    def plan(self, step: int, provider: str = "ascend-graph"):
        seq_lens = [n + step - 1 for n in self.batch.seq_lens]
        slots = [
            int(self.batch.block_tables[r, (n - 1) // 128]) * 128 + (n - 1) % 128
            for r, n in enumerate(seq_lens)
        ]
        return plan(
            self.batch.cu_seqlens_q, seq_lens, self.batch.block_tables, torch.tensor(slots),
            self.case.num_decodes, self.spec, provider=provider,
        )  # fmt: skip

    def write(self, step_plan, seed: int) -> None:
        """The step's K/V into the int8 pages, outside the attention's task group."""
        generator = torch.Generator().manual_seed(seed)
        shape = (len(self.batch.seq_lens), self.case.num_kv_heads, self.case.head_size)
        key, value = (torch.randn(*shape, generator=generator).to(self.case.dtype) for _ in "kv")
        step_plan.provider.write_kv(
            key, value, self.cache.key_cache, self.cache.value_cache, step_plan,
            scales=kv_quant.KVScales(self.cache.k_scale, self.cache.v_scale),
        )  # fmt: skip
        self.query.copy_(torch.randn(self.query.shape, generator=generator))

    def attend(self, step_plan) -> None:
        run(
            self.query, None, None, self.cache.key_cache, self.cache.value_cache, step_plan,
            self.out, k_scale=self.cache.k_scale, v_scale=self.cache.v_scale,
        )  # fmt: skip

    def expected(self, step: int) -> torch.Tensor:
        out = torch.zeros_like(self.query)
        run(
            self.query, None, None, self.cache.key_cache, self.cache.value_cache,
            self.plan(step, "reference"), out, k_scale=self.cache.k_scale,
            v_scale=self.cache.v_scale,
        )  # fmt: skip
        return out


def test_task_update_reissues_the_decode_with_the_same_scales(stand_in) -> None:
    npu, steps = stand_in.npu, QuantizedSteps()
    tolerance = DTYPE_TOLERANCE[steps.case.dtype]
    graph, capture_stream, event = npu.NPUGraph(), npu.Stream(), npu.ExternalEvent()
    first = steps.plan(1)
    with npu.graph(graph, stream=capture_stream):
        stream = npu.current_stream()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        steps.attend(first)
        handle = npu.graph_task_group_end(stream)
    event.record(npu.Stream())
    graph.replay()
    assert max_error(steps.out, steps.expected(1)) < tolerance

    for step in (2, 3):
        steps.write(steps.plan(step), seed=step)
        graph.replay()  # launched before its update, held at the task group
        step_plan, update_stream = steps.plan(step), npu.Stream()
        with npu.stream(update_stream):
            npu.graph_task_update_begin(update_stream, handle)
            steps.attend(step_plan)
            npu.graph_task_update_end(update_stream)
            event.record(update_stream)
        assert max_error(steps.out, steps.expected(step)) < tolerance
    calls = stand_in.log.of("npu_fused_infer_attention_score.out")
    assert [c.arguments["actual_seq_lengths_kv"] for c in calls] == [
        [n + s for n in steps.batch.seq_lens] for s in range(3)
    ]
    for call in calls:  # the scales are static arguments: the same tensors every step
        assert call.arguments["key_antiquant_scale"].data_ptr() == steps.cache.k_scale.data_ptr()


def test_a_stale_decode_is_visible(stand_in) -> None:
    """Without the update the replay reads the captured lengths: the test can fail."""
    npu, steps = stand_in.npu, QuantizedSteps()
    graph, event = npu.NPUGraph(), npu.ExternalEvent()
    first = steps.plan(1)
    with npu.graph(graph, stream=npu.Stream()):
        stream = npu.current_stream()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        steps.attend(first)
        npu.graph_task_group_end(stream)
    steps.write(steps.plan(2), seed=2)
    event.record(npu.Stream())
    graph.replay()
    assert max_error(steps.out, steps.expected(2)) > 10 * DTYPE_TOLERANCE[steps.case.dtype]


def test_quantizing_write_inside_a_task_update_is_refused(stand_in) -> None:
    """The quantization is device work a task update would run eagerly: a graph keeps the
    write out of the attention's task group (the provider's module doc)."""
    npu, steps = stand_in.npu, QuantizedSteps()
    graph, event = npu.NPUGraph(), npu.ExternalEvent()
    first, second = steps.plan(1), steps.plan(2)
    with npu.graph(graph, stream=npu.Stream()):
        stream = npu.current_stream()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        steps.write(first, seed=1)
        handle = npu.graph_task_group_end(stream)
    update_stream = npu.Stream()
    with npu.stream(update_stream), pytest.raises(SchemaViolation, match="inside a task update"):
        npu.graph_task_update_begin(update_stream, handle)
        steps.write(second, seed=2)


# ---------------------------------------------------------------- bad input


def _decode_setup(host_ascend: str, kind: str = KIND):
    case = next(c for c in CASES if c.name == "decode_only")
    batch = build_batch(case)
    spec = dataclasses.replace(case.spec, kv_cache_dtype=kind)
    return batch, quantize_cache(batch), spec


@pytest.mark.parametrize("kind", ["fp8", "fp8_e4m3", "fp8_per_token_head"])
def test_undocumented_kinds_are_refused_with_what_it_takes(kind, stand_in, host_ascend) -> None:
    batch, _, spec = _decode_setup(host_ascend, kind)
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='{kind}'.*\['auto', '{KIND}'\]"):
        plan(batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, batch.slot_mapping, 4, spec, provider=host_ascend)  # fmt: skip
    assert not stand_in.log.calls


def _refused(batch, cache, spec, provider, k_scale, v_scale, match: str, log) -> None:
    step = plan(
        batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, batch.slot_mapping, 4, spec,
        provider=provider,
    )  # fmt: skip
    before = cache.clone()
    with pytest.raises(ValueError, match=match):
        run(
            batch.query, batch.key, batch.value, cache.key_cache, cache.value_cache, step,
            torch.zeros_like(batch.query), k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    for name in ("key_cache", "value_cache", "k_scale", "v_scale"):
        assert torch.equal(getattr(cache, name), getattr(before, name)), f"{name} written"
    assert not log.calls, "a torch_npu op was issued"


def test_token_major_scales_are_refused_naming_the_layout(stand_in, host_ascend) -> None:
    batch, cache, spec = _decode_setup(host_ascend)
    token_major = cache.k_scale.contiguous()
    _refused(
        batch, cache, spec, host_ascend, token_major, cache.v_scale,
        r"expected float32 \[\d+, 128, 2\] with strides \(256, 1, 128\).*got .*strides \(256, 2, 1\)",
        stand_in.log,
    )  # fmt: skip


def test_scales_of_the_wrong_shape_are_refused(stand_in, host_ascend) -> None:
    batch, cache, spec = _decode_setup(host_ascend)
    per_block = cache.k_scale[:, :, 0]
    _refused(
        batch, cache, spec, host_ascend, per_block, per_block, r"must have shape .*got shape",
        stand_in.log,
    )  # fmt: skip


def test_scales_where_the_kind_takes_none_are_refused(stand_in, host_ascend) -> None:
    case = next(c for c in CASES if c.name == "decode_only")
    batch = build_batch(case)
    cache = QuantizedCache(batch.key_cache, batch.value_cache, torch.ones(1), torch.ones(1))
    _refused(
        batch, cache, case.spec, host_ascend, cache.k_scale, cache.v_scale,
        r"kv_cache_dtype='auto' takes no scales, got k_scale", stand_in.log,
    )  # fmt: skip


def test_sliding_window_with_the_int8_kind_is_refused(stand_in, host_ascend) -> None:
    batch, _, spec = _decode_setup(host_ascend)
    spec = dataclasses.replace(spec, sliding_window=64)
    with pytest.raises(ValueError, match=r"ignores pre_tokens.*sliding_window=64"):
        plan(batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, batch.slot_mapping, 4, spec, provider=host_ascend)  # fmt: skip


# ---------------------------------------------------------------- the stand-in's checks


def _decode_call(stand_in, host_ascend) -> dict:
    case = next(c for c in CASES if c.name == "decode_only")
    batch = build_batch(case)
    run_quantized(batch, quantize_cache(batch), host_ascend)
    (call,) = stand_in.log.of("npu_fused_infer_attention_score.out")
    return dict(call.arguments)


WRONG_CALLS = {
    "mode 4 with mode 5's scales": (
        lambda a: {"key_antiquant_mode": 4, "value_antiquant_mode": 4},
        "antiquant mode 4 must be",
    ),
    "modes that differ": (
        lambda a: {"key_antiquant_mode": 5, "value_antiquant_mode": 2},
        "must be equal",
    ),
    "token-major scales": (
        lambda a: {"key_antiquant_scale": a["key_antiquant_scale"].transpose(1, 2).contiguous()},
        "antiquant mode 5 must be",
    ),
    "no value scale": (lambda a: {"value_antiquant_scale": None}, "need key_antiquant_scale and"),
    "float16 scales for mode 5": (
        lambda a: {"key_antiquant_scale": a["key_antiquant_scale"].half()},
        "antiquant mode 5 must be",
    ),
    "scales with float16 keys": (
        lambda a: {
            "key": a["key"].half(),
            "value": a["value"].half(),
        },
        "antiquant scales dequantize int8 keys",
    ),
    "int8 pages on the prompt branch": (
        lambda a: {
            "query": a["query"].squeeze(2),
            "input_layout": "TND",
            "actual_seq_lengths": [2, 4],
            "actual_seq_lengths_kv": a["actual_seq_lengths_kv"][:2],
            "block_table": a["block_table"][:2],
            "out": [a["out"][0].squeeze(2), torch.zeros(1)],
            "softmax_lse_flag": False,
        },
        "documented for one query token per request only",
    ),
}


@pytest.mark.parametrize("mistake", WRONG_CALLS)
def test_documented_antiquant_constraints_are_checked(mistake, stand_in, host_ascend) -> None:
    arguments = _decode_call(stand_in, host_ascend)
    change, message = WRONG_CALLS[mistake]
    arguments.update(change(arguments))
    query, key, value = arguments.pop("query"), arguments.pop("key"), arguments.pop("value")
    with pytest.raises(SchemaViolation, match=message):
        stand_in.npu_fused_infer_attention_score.out(query, key, value, **arguments)


def test_a_multi_token_step_over_int8_pages_cannot_be_a_task(stand_in, host_ascend) -> None:
    """Verify steps (1 + k tokens) read a dequantized copy of their pages: device work
    that a task update would run eagerly, refused by the simulation (eager steps only)."""
    npu = stand_in.npu
    case = next(c for c in CASES if c.name == "spec_decoding")
    batch = build_batch(case)
    cache = quantize_cache(batch)
    step = plan(
        batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, batch.slot_mapping,
        case.num_decodes, quantized_spec(case), provider=host_ascend,
    )  # fmt: skip
    out = torch.zeros_like(batch.query)

    def attend() -> None:
        run(
            batch.query, None, None, cache.key_cache, cache.value_cache, step, out,
            k_scale=cache.k_scale, v_scale=cache.v_scale,
        )  # fmt: skip

    graph, event = npu.NPUGraph(), npu.ExternalEvent()
    with npu.graph(graph, stream=npu.Stream()):
        stream = npu.current_stream()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        attend()
        handle = npu.graph_task_group_end(stream)
    update_stream = npu.Stream()
    with npu.stream(update_stream), pytest.raises(SchemaViolation, match="inside a task update"):
        npu.graph_task_update_begin(update_stream, handle)
        attend()
