"""What the ascend provider hands torch_npu inside an attention task.

A graph task re-issued on a task update runs its torch_npu op again with new host
arguments; anything else inside the task (a copy, an allocation) would run outside the
graph, and on V1, which updates before the replay, read the previous step's rows. So:

- a strided query, key or value is refused before anything is written, not copied;
- once a step's shapes have been seen, ``run`` issues no aten op outside torch_npu's but
  views, and the next step's call hands each op the same tensors (addresses, shapes);
- with ``slot_handling="device"`` padding slots (``-1``) never reach
  ``npu_scatter_pa_kv_cache``: they go to rows of the null block, every token is
  written, and the real rows land where the reference provider puts them; a step of more
  padding tokens than the null block has rows is written by one call per block's worth of
  tokens, each naming its slots once, as torch_npu documents.
"""

from __future__ import annotations

import sys

import pytest
import torch
from ascend_cases import CASES, DTYPE_TOLERANCE, build_batch, max_error, run_provider
from torch.utils._python_dispatch import TorchDispatchMode

from npu_attention import plan, register_provider, run

ASCEND_TARGET = "npu_attention.providers.ascend:AscendProvider"
SCATTER = "npu_scatter_pa_kv_cache"
FUSED = "npu_fused_infer_attention_score.out"
DECODE = next(case for case in CASES if case.name == "decode_only")
# Room for a token more in every request's last block: two steps on one block table.
TWO_STEPS = next(case for case in CASES if case.name == "decode_window")


@pytest.fixture
def host_ascend():
    register_provider("ascend", "ascend_cases:HostAscendProvider")
    yield "ascend"
    register_provider("ascend", ASCEND_TARGET)


class _OutsideTorchNpu(TorchDispatchMode):
    """Records the aten ops issued outside calls of the ``torch_npu`` module."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.ops: list[torch._ops.OpOverload] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


class _Counted:
    """A view of ``target`` whose calls (at any attribute depth) are not recorded."""

    def __init__(self, target, mode: _OutsideTorchNpu) -> None:
        self._target, self._mode = target, mode

    def __getattr__(self, name: str):
        return _Counted(getattr(self._target, name), self._mode)

    def __call__(self, *args, **kwargs):
        self._mode.depth += 1
        try:
            return self._target(*args, **kwargs)
        finally:
            self._mode.depth -= 1


def _decode_steps(host_ascend: str):
    """Two decode steps of one batch as a runner keeps them: one slot buffer and one
    block table, rewritten in place; step 2 appends a token to every request."""
    batch = build_batch(TWO_STEPS)
    slots, tables = batch.slot_mapping.clone(), batch.block_tables.clone()
    block = TWO_STEPS.spec.block_size

    def step(number: int):
        seq_lens = [n + number - 1 for n in batch.seq_lens]
        for r, n in enumerate(seq_lens):
            slots[r] = int(tables[r, (n - 1) // block]) * block + (n - 1) % block
        return plan(
            batch.cu_seqlens_q, seq_lens, tables, slots, TWO_STEPS.num_decodes, TWO_STEPS.spec,
            provider=host_ascend, slot_handling="device", null_block=0,
        )  # fmt: skip

    return batch, step


def test_a_strided_value_is_refused_before_anything_is_written(stand_in, host_ascend) -> None:
    """vLLM's value is a view of the QKV projection's rows; the provider would have to
    copy it inside the task, so it refuses it (the bridge copies before the task)."""
    batch = build_batch(DECODE)
    step = plan(batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, batch.slot_mapping,
                DECODE.num_decodes, DECODE.spec, provider=host_ascend)  # fmt: skip
    qkv = torch.cat([batch.key, batch.value], dim=-1)  # rows of [K | V]
    value = qkv[..., DECODE.head_size :]
    assert not value.is_contiguous() and torch.equal(value, batch.value)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    with pytest.raises(ValueError, match="contiguous value"):
        run(batch.query, batch.key, value, key_cache, value_cache, step,
            torch.zeros_like(batch.query))  # fmt: skip
    assert torch.equal(key_cache, batch.key_cache) and torch.equal(value_cache, batch.value_cache)
    assert not stand_in.log.of(SCATTER)


def test_a_reissued_step_runs_only_views_outside_torch_npu(stand_in, host_ascend, monkeypatch):
    batch, step = _decode_steps(host_ascend)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    out = torch.zeros_like(batch.query)
    run(batch.query, batch.key, batch.value, key_cache, value_cache, step(1), out)
    second = step(2)  # planned outside the task, as the builder plans before the forward
    mode = _OutsideTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", _Counted(stand_in, mode))
    with mode:
        run(batch.query, batch.key, batch.value, key_cache, value_cache, second, out)
    assert mode.ops, "the dispatch mode saw nothing: it checks nothing"
    work = sorted({str(op) for op in mode.ops if not op.is_view})
    assert not work, f"work inside the task besides torch_npu's ops: {work}"


def _tensor_arguments(call) -> dict[str, tuple]:
    return {
        name: (value.data_ptr(), tuple(value.shape), value.stride())
        for name, value in call.arguments.items()
        if isinstance(value, torch.Tensor)
    }


def test_the_next_step_hands_each_op_its_tensors_again(stand_in, host_ascend) -> None:
    """A task update re-issues each op on the tensors it was captured with and changes
    host arguments only: the next step's calls name the same tensors."""
    batch, step = _decode_steps(host_ascend)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    out = torch.zeros_like(batch.query)
    for number in (1, 2):
        run(batch.query, batch.key, batch.value, key_cache, value_cache, step(number), out)
    for name in (SCATTER, FUSED):
        first, second = stand_in.log.of(name)
        assert _tensor_arguments(first) == _tensor_arguments(second), name
    lengths = [call.arguments["actual_seq_lengths_kv"] for call in stand_in.log.of(FUSED)]
    assert lengths[1] == [n + 1 for n in lengths[0]]  # the host arguments did change


def test_device_slot_handling_writes_padding_into_the_null_block(stand_in, host_ascend) -> None:
    """Two padding requests of one token (slot -1, block-table rows on the null block),
    as the bridge pads a FULL-graph decode batch: the scatter gets every token's slot,
    the padding rows in the null block; the real rows and outputs equal the reference
    provider's, and no block but the null block and the real requests' changes."""
    batch = build_batch(DECODE)
    block = DECODE.spec.block_size
    null = batch.key_cache.shape[0]  # one block past those build_batch hands out
    pad_rows = torch.zeros(1, *batch.key_cache.shape[1:], dtype=batch.key_cache.dtype)
    key_cache = torch.cat([batch.key_cache, pad_rows])
    value_cache = torch.cat([batch.value_cache, pad_rows])
    real = DECODE.num_decodes
    cu = [*batch.cu_seqlens_q, real + 1, real + 2]
    seq_lens = [*batch.seq_lens, 1, 1]
    tables = torch.cat([batch.block_tables, torch.full((2, batch.block_tables.shape[1]), null)])
    slots = batch.slot_mapping.clone()  # [-1] * DECODE.padding after the real tokens
    step = plan(cu, seq_lens, tables.to(torch.int32), slots, real + 2, DECODE.spec,
                provider=host_ascend, slot_handling="device", null_block=null)  # fmt: skip
    out = torch.zeros_like(batch.query)
    run(batch.query, batch.key, batch.value, key_cache, value_cache, step, out)
    (scatter,) = stand_in.log.of(SCATTER)
    written = scatter.arguments["slot_mapping"].tolist()
    assert written[:real] == batch.slot_mapping[:real].tolist()
    assert written[real:] == [null * block + token % block for token in (real, real + 1)]
    expected = run_provider(batch, "reference")
    tolerance = DTYPE_TOLERANCE[DECODE.dtype]
    assert max_error(out[:real], expected.out[:real]) < tolerance
    assert torch.equal(key_cache[:null], expected.key_cache)
    assert torch.equal(value_cache[:null], expected.value_cache)
    torch.testing.assert_close(key_cache[null, real : real + 2], batch.key[real : real + 2])


def _other_rank_slots(table: torch.Tensor, tokens: int, block: int, rank: int = 0) -> torch.Tensor:
    """Slots of one prefill of ``tokens`` tokens as decode context parallelism gives
    ``rank`` of 2: positions ``p`` with ``p % 2 == rank`` are this rank's (local position
    ``p // 2``), the others another rank's (``-1``), so more than ``block`` tokens of the
    step have slot ``-1``."""
    local = torch.arange(tokens) // 2
    slots = table[0, local // block].long() * block + local % block
    return torch.where(torch.arange(tokens) % 2 == rank, slots, -1)


PADDED_TOKENS = 300  # 150 padding slots: more than the null block's 128 rows


def test_device_slot_handling_gives_each_padding_token_of_a_call_its_own_row(
    stand_in, host_ascend
) -> None:
    """A 300-token prefill of which 150 tokens are another DCP rank's (slot -1): every
    ``npu_scatter_pa_kv_cache`` call names each slot once, as torch_npu documents (the
    stand-in refuses duplicates), all padding rows land in the null block, and every other
    block equals what the reference provider writes."""
    spec = DECODE.spec
    block, heads, size = spec.block_size, spec.num_kv_heads, spec.head_size
    generator = torch.Generator().manual_seed(3)
    table = torch.tensor([[1, 2, 3]], dtype=torch.int32)  # block 0: the null block
    slots = _other_rank_slots(table, PADDED_TOKENS, block)
    key, value = (torch.randn(PADDED_TOKENS, heads, size, generator=generator).to(spec.dtype)
                  for _ in range(2))  # fmt: skip
    query = torch.randn(PADDED_TOKENS, spec.num_heads, size, generator=generator).to(spec.dtype)
    caches = {}
    for provider in ("reference", host_ascend):
        key_cache = torch.zeros(4, block, heads, size, dtype=spec.dtype)
        value_cache = torch.zeros_like(key_cache)
        step = plan([0, PADDED_TOKENS], [PADDED_TOKENS], table, slots.clone(), 0, spec,
                    provider=provider, slot_handling="device", null_block=0)  # fmt: skip
        out = torch.zeros_like(query)
        run(query, key, value, key_cache, value_cache, step, out)
        caches[provider] = key_cache, value_cache
    calls = stand_in.log.of(SCATTER)
    assert [call.arguments["key"].shape[0] for call in calls] == [128, 128, 44]
    written = torch.cat([call.arguments["slot_mapping"] for call in calls])
    for call in calls:
        call_slots = call.arguments["slot_mapping"]
        assert call_slots.unique().numel() == call_slots.numel()
    padding = slots < 0
    assert bool((written[padding] // block == 0).all()), written[padding]
    assert torch.equal(written[~padding], slots[~padding])
    for expected, actual in zip(caches["reference"], caches[host_ascend]):
        assert torch.equal(actual[1:], expected[1:])


def test_a_write_of_several_calls_is_one_task_a_graph_update_reissues(
    stand_in, host_ascend
) -> None:
    """A captured write of more padding tokens than the null block has rows (a FULL graph
    over 128 tokens): the task group holds its three scatter calls, a task update
    re-issues the three on the tensors of the capture (the runner rewrites its slot
    buffer in place), and the replay writes the new step's rows where the reference
    provider does."""
    npu, spec = stand_in.npu, DECODE.spec
    block, shape = spec.block_size, (PADDED_TOKENS, spec.num_kv_heads, spec.head_size)
    table = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    slots = torch.empty(PADDED_TOKENS, dtype=torch.int64)  # the runner's slot buffer
    key, value = torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype)
    caches = [torch.zeros(4, block, *shape[1:], dtype=spec.dtype) for _ in range(2)]

    def step(rank: int, provider: str = host_ascend):
        slots.copy_(_other_rank_slots(table, PADDED_TOKENS, block, rank))
        return plan([0, PADDED_TOKENS], [PADDED_TOKENS], table, slots, 0, spec,
                    provider=provider, slot_handling="device", null_block=0)  # fmt: skip

    graph, event = npu.NPUGraph(), npu.ExternalEvent()
    first = step(0)
    with npu.graph(graph, stream=npu.Stream()):
        stream = npu.current_stream()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        first.provider.write_kv(key, value, *caches, first)
        handle = npu.graph_task_group_end(stream)
    generator = torch.Generator().manual_seed(5)
    key.copy_(torch.randn(shape, generator=generator))
    value.copy_(torch.randn(shape, generator=generator))
    second, update_stream = step(1), npu.Stream()
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        second.provider.write_kv(key, value, *caches, second)
        npu.graph_task_update_end(update_stream)
        event.record(update_stream)
    graph.replay()
    calls = stand_in.log.of(SCATTER)
    rows_per_call = [call.arguments["key"].shape[0] for call in calls]
    assert rows_per_call == [128, 128, 44] * 2  # captured, re-issued
    expected = [torch.zeros_like(cache) for cache in caches]
    reference = step(1, "reference")
    reference.provider.write_kv(key, value, *expected, reference)
    for actual, wanted in zip(caches, expected):
        assert torch.equal(actual[1:], wanted[1:])
        assert actual[1:].any()


def test_mla_device_slot_handling_gives_each_padding_token_of_a_call_its_own_row(
    stand_in, host_ascend_mla
) -> None:
    """The MLA latent write of the same DCP-shaped prefill: one scatter call per 128 tokens,
    each naming its slots once; the latents land where the reference provider puts them."""
    from ascend_mla_cases import MLA_CASES

    from npu_attention import LatentCache, mla_write_cache

    spec = MLA_CASES[0].spec
    block = spec.block_size
    generator = torch.Generator().manual_seed(4)
    table = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    slots = _other_rank_slots(table, PADDED_TOKENS, block)
    kv_c = torch.randn(PADDED_TOKENS, spec.kv_lora_rank, generator=generator).to(spec.dtype)
    k_pe = torch.randn(PADDED_TOKENS, spec.qk_rope_head_dim, generator=generator).to(spec.dtype)
    caches = {}
    for provider in ("reference", host_ascend_mla):
        cache = LatentCache(torch.zeros(4, block, spec.kv_lora_rank, dtype=spec.dtype),
                            torch.zeros(4, block, spec.qk_rope_head_dim, dtype=spec.dtype))  # fmt: skip
        step = plan([0, PADDED_TOKENS], [PADDED_TOKENS], table, slots.clone(), 0, spec,
                    provider=provider, slot_handling="device", null_block=0)  # fmt: skip
        mla_write_cache(kv_c, k_pe, cache, step)
        caches[provider] = cache
    calls = stand_in.log.of(SCATTER)
    assert [call.arguments["key"].shape[0] for call in calls] == [128, 128, 44]
    for call in calls:
        call_slots = call.arguments["slot_mapping"]
        assert call_slots.unique().numel() == call_slots.numel()
    expected, actual = caches["reference"], caches[host_ascend_mla]
    assert torch.equal(actual.kv_c[1:], expected.kv_c[1:])
    assert torch.equal(actual.k_pe[1:], expected.k_pe[1:])


def test_device_slot_handling_needs_a_null_block(host_ascend) -> None:
    batch = build_batch(DECODE)
    with pytest.raises(ValueError, match="null_block"):
        plan(batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, batch.slot_mapping,
             DECODE.num_decodes, DECODE.spec, provider="reference", slot_handling="device")  # fmt: skip
    with pytest.raises(ValueError, match="slot_handling"):
        plan(batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, batch.slot_mapping,
             DECODE.num_decodes, DECODE.spec, provider="reference", slot_handling="cpu")  # fmt: skip


MLA_TARGET = "npu_attention.providers.ascend_mla:AscendMLAProvider"


@pytest.fixture
def host_ascend_mla():
    register_provider("ascend", "ascend_mla_cases:HostAscendMLAProvider", family="mla")
    yield "ascend"
    register_provider("ascend", MLA_TARGET, family="mla")


def _padded_view(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x`` ``[T, N, D]`` as the first ``N`` heads of a zeroed ``[T, heads, D]``."""
    buffer = x.new_zeros(x.shape[0], heads, x.shape[2])
    buffer[:, : x.shape[1]] = x
    return buffer[:, : x.shape[1]]


def test_mla_decode_reads_padded_heads_in_place(stand_in, host_ascend_mla, monkeypatch) -> None:
    """16 query heads, which the fused op takes only as 32: given the first 16 heads of
    zeroed 32-head buffers (``decode_heads``, as the bridge's MLA impl hands them), the
    decode runs no aten work outside torch_npu's op but views, and equals the reference
    provider; the op is handed the whole buffers, not copies."""
    from ascend_mla_cases import MLA_CASES, MLA_TOLERANCE, build_mla_batch, run_mla_provider

    from npu_attention import LatentCache, mla_decode, mla_write_cache
    from npu_attention.registry import get_provider

    case = next(c for c in MLA_CASES if c.name == "chunked_prefill")  # 16 heads, 2 decodes
    batch = build_mla_batch(case)
    heads = get_provider("ascend", family="mla").decode_heads(case.spec)
    assert (case.num_heads, heads) == (16, 32)
    step = plan(batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, batch.slot_mapping,
                case.num_decodes, case.spec, provider=host_ascend_mla)  # fmt: skip
    cache = LatentCache(batch.cache.kv_c.clone(), batch.cache.k_pe.clone())
    mla_write_cache(batch.kv_c, batch.k_pe, cache, step)
    q_latent, q_rope = (_padded_view(x, heads) for x in (batch.q_latent, batch.q_rope))
    out = _padded_view(torch.zeros_like(batch.q_latent), heads)
    mla_decode(q_latent, q_rope, cache, step, out)  # sizes the workspace
    mode = _OutsideTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", _Counted(stand_in, mode))
    with mode:
        mla_decode(q_latent, q_rope, cache, step, out)
    work = sorted({str(op) for op in mode.ops if not op.is_view})
    assert not work, f"work inside the task besides torch_npu's ops: {work}"
    first, second = stand_in.log.of("npu_fused_infer_attention_score_v2.out")
    assert second.arguments["query"].data_ptr() == q_latent.data_ptr()
    assert second.arguments["query"].shape[1] == heads
    assert _tensor_arguments(first) == _tensor_arguments(second)
    expected = run_mla_provider(batch, "reference").decode_out
    rows = step.num_decode_tokens
    assert max_error(out[:rows], expected[:rows]) < MLA_TOLERANCE[case.dtype]
