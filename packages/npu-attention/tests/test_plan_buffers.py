"""Fixed-buffer mode: stable addresses, neutral padding, same results as plain mode."""

from __future__ import annotations

import torch
from npu_attention_cases import assert_close_to_oracle, make_case, run_case

from npu_attention import AttentionSpec, PlanBuffers, plan

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)
BATCHES = [  # (query_lens, context_lens, num_decodes)
    ([1, 1, 1, 1, 1, 1], [20, 3, 40, 1, 0, 63], 6),
    ([1, 1, 8, 30], [40, 2, 17, 0], 2),
    ([12], [5], 0),
]


def _addresses(step) -> list[int]:
    names = ("cu_seqlens_q", "seq_lens", "context_lens", "block_tables", "slot_mapping")
    return [getattr(step, name).data_ptr() for name in names]


def test_addresses_are_stable_and_results_match_plain_mode() -> None:
    buffers = PlanBuffers.allocate(8, 64, 8, device="cpu")
    expected_addresses = [
        buffers.cu_seqlens_q.data_ptr(),
        buffers.seq_lens.data_ptr(),
        buffers.context_lens.data_ptr(),
        buffers.block_tables.data_ptr(),
        buffers.slot_mapping.data_ptr(),
    ]
    for seed, (q, ctx, dec) in enumerate(BATCHES):
        case = make_case(SPEC, q, ctx, dec, seed=seed, pad_tokens=2)
        out_fixed, _, step = run_case(case, seed, buffers=buffers)
        out_plain, _, plain = run_case(case, seed)
        assert _addresses(step) == expected_addresses
        assert step.buffers is buffers
        assert torch.equal(out_fixed, out_plain)
        assert_close_to_oracle(case, out_fixed)
        for name in ("cu_seqlens_q", "seq_lens", "context_lens", "slot_mapping"):
            assert torch.equal(getattr(step, name), getattr(plain, name)), name
        width = plain.block_tables.shape[1]
        assert torch.equal(step.block_tables[:, :width], plain.block_tables)


def test_padding_beyond_the_step_is_neutral() -> None:
    buffers = PlanBuffers.allocate(4, 10, 6, device="cpu")
    plan([0, 1, 2, 3, 9], [5, 6, 7, 30], torch.full((4, 6), 3), list(range(10)), 3, SPEC, buffers=buffers)  # fmt: skip
    plan([0, 1, 4], [9, 3], [[1, 2], [4, 0]], [7, 8, 9, 10], 1, SPEC, buffers=buffers)
    assert buffers.cu_seqlens_q.tolist() == [0, 1, 4, 4, 4]
    assert buffers.seq_lens.tolist() == [9, 3, 0, 0]
    assert buffers.context_lens.tolist() == [8, 0, 0, 0]
    assert buffers.slot_mapping.tolist() == [7, 8, 9, 10] + [-1] * 6
    assert buffers.block_tables[:2].tolist() == [[1, 2, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]]


def test_table_wider_than_buffer_when_the_step_fits() -> None:
    buffers = PlanBuffers.allocate(2, 8, 2, device="cpu")
    wide = [[1, 2, 9, 9, 9], [3, 9, 9, 9, 9]]
    step = plan([0, 1, 2], [20, 3], wide, [4, 5], 2, SPEC, buffers=buffers, num_blocks=10)
    assert step.block_tables.tolist() == [[1, 2], [3, 9]]
