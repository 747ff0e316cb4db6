"""Graph counters live in their owners (``graphs/counters.py``): each graph component
counts into its own, two components in one process count apart, and a model runner's
``graph_counters()`` is the sum of its own and its components' (V1 and V2 runners).

The references are counted by hand: the steps each test runs on each component."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

from npu_vllm_bridge.graphs.counters import GraphCounters, sum_counters
from npu_vllm_bridge.graphs.full_graphs import DRAFTER, MODEL, FullGraphs
from npu_vllm_bridge.graphs.runner import GraphRunnerMixin
from npu_vllm_bridge.graphs.v2_draft_graphs import BridgeSpeculatorGraphManager
from npu_vllm_bridge.graphs.v2_graphs import BridgeModelGraphManager
from npu_vllm_bridge.graphs.v2_runner import GraphManagerHook
from npu_vllm_bridge.graphs.wrapper import BridgeGraphWrapper

KEY = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=4, num_reqs=4)


def _full_graphs(buffer: torch.Tensor, role: str = MODEL) -> FullGraphs:
    """A graph component of ``2 * buffer`` (no attention task) on host graphs, captured."""
    full = FullGraphs(lambda: buffer * 2, name=role, expected_tasks=0, role=role, backend="host")
    full.capture(KEY)
    return full


def _replay(full: FullGraphs, times: int, buffer: torch.Tensor) -> None:
    for step in range(times):
        buffer.fill_(step + 1.0)
        torch.testing.assert_close(full.replay(KEY, {}), buffer * 2, rtol=0, atol=0)


def _counts(counters: GraphCounters) -> tuple[int, ...]:
    return (
        counters.captured,
        counters.replayed_steps,
        counters.draft_captured,
        counters.draft_replayed_steps,
    )


def test_two_full_graphs_in_one_process_count_apart() -> None:
    """Two models' graph components and a drafter's: each counts its own replays only
    (one process-wide record would give every one of them all six)."""
    buffers = [torch.ones(3) for _ in range(3)]
    first, second = _full_graphs(buffers[0]), _full_graphs(buffers[1])
    drafter = _full_graphs(buffers[2], role=DRAFTER)
    _replay(first, 2, buffers[0])
    _replay(second, 3, buffers[1])
    _replay(drafter, 1, buffers[2])
    assert _counts(first.counters) == (1, 2, 0, 0)
    assert _counts(second.counters) == (1, 3, 0, 0)
    assert _counts(drafter.counters) == (1, 0, 1, 1)  # a drafter's capture is also captured
    first.clear(forget_counts=True)  # as after the memory profile
    assert _counts(first.counters) == (0, 0, 0, 0) and _counts(second.counters) == (1, 3, 0, 0)


def test_sum_adds_counts_keeps_the_largest_capture_bytes_and_checks_its_parts() -> None:
    a = GraphCounters(captured=2, replayed_steps=5, capture_bytes=300, capture_seconds=0.5)
    b = GraphCounters(captured=1, eager_steps=4, capture_bytes=700, serving=True)
    total = sum_counters([a, b])
    assert (total.captured, total.replayed_steps, total.eager_steps) == (3, 5, 4)
    assert total.capture_seconds == 0.5 and total.serving
    # A capture at first use records the backend's whole memory in use, shared by all.
    assert total.capture_bytes == 700
    assert total is not a and total is not b and a.captured == 2  # parts untouched
    with pytest.raises(TypeError, match="GraphCounters, got dict"):
        sum_counters([a, {"captured": 1}])


def _expected_sum(parts: list[GraphCounters]) -> dict:
    """The field-by-field sum of ``parts`` written out (capture_bytes: the largest)."""
    expected = {}
    for field in fields(GraphCounters):
        values = [getattr(part, field.name) for part in parts]
        if field.name == "capture_bytes":
            expected[field.name] = max(values)
        elif field.name == "serving":
            expected[field.name] = any(values)
        else:
            expected[field.name] = sum(values)
    return expected


class _V1Runner(GraphRunnerMixin):
    """A V1 runner at the point of its counters: its engine's config."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__()
        self.vllm_config = vllm_config


def _step(wrapper: BridgeGraphWrapper, config: VllmConfig, mode: CUDAGraphMode) -> None:
    x = torch.ones(3)
    key = BatchDescriptor(num_tokens=3)
    with set_forward_context({}, config, cudagraph_runtime_mode=mode, batch_descriptor=key):
        torch.testing.assert_close(wrapper(x), x * 2)


def test_a_v1_runners_counters_are_the_sum_of_its_engines_wrappers() -> None:
    """Two engines' configs in one process: each runner sums its own engine's graph
    wrappers (a FULL one, a first PIECEWISE piece) and its own start-up counts."""
    ours, theirs = VllmConfig(), VllmConfig()
    full = BridgeGraphWrapper(
        lambda x: x * 2, ours, CUDAGraphMode.FULL, num_attention_layers=0, graph_backend="host"
    )
    piece = BridgeGraphWrapper(
        lambda x: x * 2, ours, CUDAGraphMode.PIECEWISE, graph_backend="host", first_piece=True
    )
    other = BridgeGraphWrapper(
        lambda x: x * 2, theirs, CUDAGraphMode.FULL, num_attention_layers=0, graph_backend="host"
    )
    for _ in range(3):  # a capture, then two replays
        _step(full, ours, CUDAGraphMode.FULL)
        _step(other, theirs, CUDAGraphMode.FULL)
    _step(full, ours, CUDAGraphMode.NONE)  # a step without graphs
    for _ in range(2):
        _step(piece, ours, CUDAGraphMode.PIECEWISE)
    runner, their_runner = _V1Runner(ours), _V1Runner(theirs)
    runner.runner_counters.capture_seconds = 1.5
    runner.runner_counters.estimated_bytes = 4096

    parts = [runner.runner_counters, full.counters, piece.counters]
    assert runner.graph_counters().as_dict() == {
        **_expected_sum(parts),
        "yields_per_split_forward": 0.0,
    }
    counters = runner.graph_counters()
    assert (counters.captured, counters.replayed_steps, counters.eager_steps) == (2, 2, 1)
    assert (counters.replayed_pieces, counters.capture_seconds) == (1, 1.5)
    summed = their_runner.graph_counters()  # the other engine's wrapper alone
    assert (summed.captured, summed.replayed_steps, summed.eager_steps) == (1, 2, 0)
    counters.replayed_steps = 99  # a new object each call: the components are untouched
    assert full.counters.replayed_steps == 2

    runner.start_serving()  # start-up over: its warm-up steps forgotten, serving
    counters = runner.graph_counters()
    assert counters.eager_steps == 0 and counters.replayed_steps == 2
    assert full.counters.serving and piece.counters.serving
    runner.reset_graph_counters()
    assert runner.graph_counters() == GraphCounters()
    assert other.counters.replayed_steps == 2  # the other engine's kept


class _V2Runner(GraphManagerHook):
    """A V2 runner at the point of its counters: its graph manager, its speculator's
    managers and its engine's config."""

    def __init__(self, manager: BridgeModelGraphManager, speculator: object) -> None:
        super().__init__()
        self.vllm_config = VllmConfig()
        self.cudagraph_manager = manager
        self.speculator = speculator


def _manager(cls: type, full: FullGraphs) -> object:
    manager = cls.__new__(cls)
    manager.full = full
    return manager


def test_a_v2_runners_counters_are_the_sum_of_its_managers() -> None:
    """The target's manager and the drafter's two (one graph component each) summed:
    the drafter's replays in ``draft_*``, the target's in ``replayed_steps``."""
    buffers = [torch.ones(3) for _ in range(3)]
    target = _full_graphs(buffers[0])
    prefill, decode = (_full_graphs(b, role=DRAFTER) for b in buffers[1:])
    _replay(target, 4, buffers[0])
    _replay(prefill, 2, buffers[1])
    _replay(decode, 3, buffers[2])
    speculator = SimpleNamespace(
        prefill_cudagraph_manager=_manager(BridgeSpeculatorGraphManager, prefill),
        decode_cudagraph_manager=_manager(BridgeSpeculatorGraphManager, decode),
        cudagraph_manager=None,
    )
    runner = _V2Runner(_manager(BridgeModelGraphManager, target), speculator)
    runner.runner_counters.capture_bytes = 10
    parts = [runner.runner_counters, target.counters, prefill.counters, decode.counters]
    assert runner.graph_counters().as_dict() == {
        **_expected_sum(parts),
        "yields_per_split_forward": 0.0,
    }
    assert _counts(runner.graph_counters()) == (3, 4, 2, 5)
