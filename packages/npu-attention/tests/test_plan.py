"""``plan``: batch states, host lists and device tensors, input forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from npu_attention import AttentionSpec, BatchState, plan
from npu_attention.plan import classify

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, block_size=16)


def _tables(num_reqs: int, width: int = 4) -> torch.Tensor:
    return torch.arange(1, 1 + num_reqs * width).reshape(num_reqs, width)


def test_fields_of_a_mixed_batch() -> None:
    cu, seq = [0, 1, 2, 7, 10], [9, 33, 5, 20]
    step = plan(cu, seq, _tables(4), torch.arange(12), 2, SPEC)
    assert step.state is BatchState.CHUNKED_PREFILL
    assert (step.num_reqs, step.num_decodes, step.num_prefills) == (4, 2, 2)
    assert (step.num_decode_tokens, step.num_actual_tokens, step.num_prefill_tokens) == (2, 10, 8)
    assert (step.max_query_len, step.max_seq_len, step.max_context_len) == (5, 33, 32)
    assert step.cu_seqlens_q_host == cu
    assert step.actual_seq_lengths_q == cu[1:]
    assert step.query_lens_host == [1, 1, 5, 3]
    assert step.seq_lens_host == seq
    assert step.context_lens_host == [8, 32, 0, 17]
    assert step.cu_seqlens_q.tolist() == cu
    assert step.seq_lens.tolist() == seq
    assert step.context_lens.tolist() == [8, 32, 0, 17]
    assert step.block_tables.tolist() == _tables(4).tolist()
    assert step.slot_mapping.tolist() == list(range(12))
    for name in ("cu_seqlens_q", "seq_lens", "context_lens", "block_tables"):
        assert getattr(step, name).dtype == torch.int32, name
    assert step.slot_mapping.dtype == torch.int64
    assert step.device == torch.device("cpu")
    assert step.provider.name == "reference"
    assert step.provider_data is not None


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "num_decodes", "state"),
    [
        ([3, 5], [0, 0], 0, BatchState.PREFILL_NO_CACHE),
        ([3, 5], [0, 4], 0, BatchState.PREFILL_CACHE_HIT),
        ([1, 1, 1], [4, 0, 9], 3, BatchState.DECODE_ONLY),
        ([3, 2, 3], [4, 0, 9], 3, BatchState.SPEC_DECODING),
        ([1, 6], [4, 0], 1, BatchState.CHUNKED_PREFILL),
        ([2, 6], [4, 9], 1, BatchState.CHUNKED_PREFILL),
    ],
)
def test_states(query_lens, context_lens, num_decodes, state) -> None:
    assert classify(np.array(query_lens), np.array(context_lens), num_decodes) is state
    spec = AttentionSpec(4, 2, 64, 16, num_speculative_tokens=2)
    cu = [0, *np.cumsum(query_lens).tolist()]
    seq = [q + c for q, c in zip(query_lens, context_lens)]
    step = plan(cu, seq, _tables(len(seq)), torch.arange(cu[-1]), num_decodes, spec)
    assert step.state is state


@pytest.mark.parametrize(
    "convert",
    [list, np.array, torch.tensor, lambda x: torch.tensor(x, dtype=torch.int32)],
    ids=["list", "numpy", "tensor", "int32"],
)
def test_input_forms_give_the_same_plan(convert) -> None:
    cu, seq, slots = [0, 1, 4], [6, 3], [20, 21, 22, 23]
    tables = [[1, 2], [3, 0]]
    step = plan(convert(cu), convert(seq), convert(tables), convert(slots), 1, SPEC)
    assert step.cu_seqlens_q_host == cu
    assert step.seq_lens_host == seq
    assert step.block_tables.tolist() == tables
    assert step.slot_mapping.tolist() == slots
    assert step.state is BatchState.CHUNKED_PREFILL


def test_padded_slot_mapping_and_empty_batch() -> None:
    step = plan([0, 1], [4], _tables(1), [5, -1, -1, -1], 1, SPEC)
    assert step.slot_mapping.tolist() == [5, -1, -1, -1]
    assert step.num_actual_tokens == 1
    empty = plan([0], [], torch.zeros(0, 4, dtype=torch.int64), [], 0, SPEC)
    assert (empty.num_reqs, empty.num_actual_tokens, empty.state) == (
        0,
        0,
        BatchState.DECODE_ONLY,
    )


def test_plan_without_cache() -> None:
    step = plan([0, 3, 5], [3, 2], None, None, 0, SPEC)
    assert not step.has_cache
    assert step.block_tables.shape == (2, 0)
    assert step.slot_mapping.tolist() == [-1] * 5


def test_block_tables_stay_on_their_device_when_already_int32() -> None:
    tables = _tables(2).to(torch.int32)
    step = plan([0, 1, 2], [5, 6], tables, [1, 2], 2, SPEC)
    assert step.block_tables.data_ptr() == tables.data_ptr()


def test_lengths_given_on_the_device_are_used_in_place() -> None:
    cu, seq = [0, 1, 2, 7, 10], [9, 33, 5, 20]
    given = (
        torch.tensor([*cu, 99], dtype=torch.int32),
        torch.tensor([*seq, 99, 99], dtype=torch.int32),
    )
    uploaded = plan(cu, seq, _tables(4), torch.arange(12), 2, SPEC)
    step = plan(cu, seq, _tables(4), torch.arange(12), 2, SPEC, device_lengths=given)
    assert step.cu_seqlens_q.data_ptr() == given[0].data_ptr()
    assert step.seq_lens.data_ptr() == given[1].data_ptr()
    for name in ("cu_seqlens_q", "seq_lens", "context_lens"):
        assert torch.equal(getattr(step, name), getattr(uploaded, name)), name
    assert step.context_lens.dtype == torch.int32
    for name in ("state", "cu_seqlens_q_host", "seq_lens_host", "max_context_len"):
        assert getattr(step, name) == getattr(uploaded, name), name
