"""Capture planning: default sizes, padding, uniform decode, tensor parallel, device budget."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from npu_graphs import (
    CapturePlan,
    default_capture_sizes,
    graphs_within_stream_budget,
    plan_capture,
)


def test_default_sizes_follow_vllm():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[sizes.index(248) : sizes.index(248) + 4] == [248, 256, 272, 288]
    assert sizes[-1] == 512 and sizes == sorted(set(sizes))


@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=20),
    num_tokens=st.integers(1, 400),
)
def test_padding_is_the_smallest_size_that_fits(sizes, num_tokens):
    plan = plan_capture(sizes)
    fitting = [s for s in sizes if s >= num_tokens]
    assert plan.padded_size(num_tokens) == (min(fitting) if fitting else None)


def test_padding_table():
    plan = plan_capture([1, 2, 4, 8])
    assert plan.padding_table() == [1, 1, 2, 4, 4, 8, 8, 8, 8]
    assert plan.padded_size(9) is None
    assert plan.capture_order() == [8, 4, 2, 1]


def test_uniform_decode_sizes_are_multiples_of_the_query_len():
    plan = plan_capture([1, 2, 4, 8, 16, 24, 32], num_speculative_tokens=2, max_num_reqs=8)
    assert plan.uniform_decode_query_len == 3
    assert plan.uniform_decode_sizes == (3, 6, 9, 18, 24)  # <= 8 requests x 3 tokens
    assert plan.padded_uniform_decode_size(7) == 9
    assert plan.padded_uniform_decode_size(25) is None
    assert plan.capture_order(uniform_decode=True) == [24, 18, 9, 6, 3]
    assert plan_capture([1, 2, 4]).uniform_decode_sizes == ()  # no max_num_reqs


def test_tensor_parallel_keeps_multiples():
    plan = plan_capture(max_size=32, tp_size=4, max_num_reqs=16, num_speculative_tokens=1)
    assert plan.sizes == (4, 8, 16, 24, 32)
    assert plan.uniform_decode_sizes == (4, 8, 16, 24, 32)  # multiples of lcm(2, 4)
    odd = plan_capture([3, 6, 9, 12], tp_size=3, num_speculative_tokens=1, max_num_reqs=6)
    assert odd.uniform_decode_sizes == (6, 12)  # multiples of lcm(2, 3), <= 6 x 2
    with pytest.raises(ValueError, match="multiple of tp_size=3"):
        plan_capture([1, 2, 4], tp_size=3)


def test_budget_keeps_an_evenly_spread_subset_and_says_so(caplog):
    asked = default_capture_sizes(512)
    with caplog.at_level(logging.WARNING, logger="npu_graphs.planner"):
        plan = plan_capture(asked, max_graphs=10)
    assert len(plan.sizes) == 10
    assert plan.sizes[0] == 1 and plan.sizes[-1] == 512
    gaps = [asked.index(b) - asked.index(a) for a, b in zip(plan.sizes, plan.sizes[1:])]
    assert max(gaps) - min(gaps) <= 1  # evenly spread over the asked list
    assert set(plan.dropped) == set(asked) - set(plan.sizes)
    assert len(caplog.records) == 1 and "device holds 10" in caplog.records[0].getMessage()


def test_budget_is_shared_with_uniform_decode_graphs():
    plan = plan_capture(max_size=256, max_num_reqs=64, num_speculative_tokens=1, max_graphs=12)
    assert plan.num_graphs == 12 and plan.uniform_decode_sizes
    assert plan.sizes[-1] == 256


def test_no_log_within_budget(caplog):
    with caplog.at_level(logging.WARNING, logger="npu_graphs.planner"):
        plan = plan_capture([1, 2, 4], max_graphs=3)
    assert plan.sizes == (1, 2, 4) and plan.dropped == () and not caplog.records


def test_npu_stream_budget():
    assert graphs_within_stream_budget(31) == 2048 // 32 == 64
    assert graphs_within_stream_budget(0, stream_budget=10) == 10


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "give capture sizes or a max_size"),
        ({"max_size": 0}, ValueError, "max_size must be >= 1, got 0"),
        ({"max_size": 8.0}, TypeError, "max_size must be an int, got float"),
        ({"sizes": [1, 0]}, ValueError, "capture size must be >= 1, got 0"),
        ({"sizes": "124"}, TypeError, "sequence of ints, got str"),
        ({"sizes": [16], "max_size": 8}, ValueError, "no capture size left"),
        ({"max_size": 8, "tp_size": 0}, ValueError, "tp_size must be >= 1"),
        ({"max_size": 8, "num_speculative_tokens": -1}, ValueError, "num_speculative_tokens"),
        ({"max_size": 8, "max_num_reqs": 0}, ValueError, "max_num_reqs must be >= 1"),
        ({"max_size": 8, "max_graphs": 0}, ValueError, "max_graphs must be >= 1"),
        ({"max_size": 8, "max_graphs": True}, TypeError, "max_graphs must be an int, got bool"),
    ],
)
def test_bad_input_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_capture(**kwargs)


def test_bad_token_counts_are_refused():
    plan = CapturePlan((1, 2))
    with pytest.raises(ValueError, match="num_tokens must be >= 1, got 0"):
        plan.padded_size(0)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        plan.padded_size(1.5)
    with pytest.raises(ValueError, match="num_layers must be >= 0"):
        graphs_within_stream_budget(-1)
