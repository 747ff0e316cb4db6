"""The V2 graph manager's FULL replay (``graphs/v2_graphs.py``); capture and replay
inside vLLM are exercised by tests-integration/test_v2_host_mode.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

from npu_vllm_bridge.graphs.v2_graphs import BridgeModelGraphManager, NpuGraphsCapture

DESC = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=4, num_reqs=4)


def _manager(calls: list, num_tasks: int = 2) -> BridgeModelGraphManager:
    """A manager whose graph component has stand-ins for its task registry and
    npu-graphs wrapper (no capture): ``replay_step`` logs the key and the step it is
    handed (the order each graph backend takes is npu-graphs' own, tested there and in
    tests-conformance)."""
    from npu_vllm_bridge.graphs.counters import GraphCounters
    from npu_vllm_bridge.graphs.full_graphs import MODEL, FullGraphs

    manager = BridgeModelGraphManager.__new__(BridgeModelGraphManager)
    full = FullGraphs.__new__(FullGraphs)
    full.role, full.counters = MODEL, GraphCounters()
    full.tasks = SimpleNamespace(num_tasks=lambda desc: num_tasks)
    full.graphs = SimpleNamespace(
        replay_step=lambda desc, step: calls.append(("replay_step", desc, step))
    )
    manager.full = full
    manager.is_last_pp_rank, manager.use_aux_hidden_state_outputs = True, False
    manager.hidden_states = torch.arange(8.0)[:, None]  # vLLM's persistent output buffer
    return manager


def test_replay_hands_npu_graphs_the_steps_metadata() -> None:
    calls: list = []
    manager = _manager(calls)
    step = {"model.layers.0.self_attn.attn": object(), "model.layers.1.self_attn.attn": object()}
    manager.step_attn_metadata = step
    hidden_states = manager.run_fullgraph(DESC)
    assert calls == [("replay_step", DESC, step)]
    counters = manager.full.counters
    assert (counters.replayed_steps, counters.task_updates) == (1, 1)
    assert torch.equal(hidden_states, manager.hidden_states[:4])  # vLLM's output slicing
    assert manager.step_attn_metadata is None  # one step's metadata serves one replay


def test_a_graph_without_tasks_replays_without_update() -> None:
    calls: list = []
    manager = _manager(calls, num_tasks=0)
    manager.step_attn_metadata = {}
    manager.run_fullgraph(DESC)
    assert calls == [("replay_step", DESC, None)]  # the step is not read
    counters = manager.full.counters
    assert (counters.replayed_steps, counters.task_updates) == (1, 0)


def test_replay_without_the_steps_metadata_is_refused() -> None:
    manager = _manager([])
    with pytest.raises(ValueError, match="without the step's attention metadata"):
        manager.run_fullgraph(DESC)


PIECEWISE = [
    BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=n, num_reqs=None)
    for n in (16, 8, 4, 1)
]
FULL = [
    BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=n, num_reqs=n)
    for n in (8, 4, 2)
]


class _Backend:
    """Host-graph accounting stand-in: each captured graph keeps ``3 + 10 * num_tokens``
    bytes of its own; the shared pool is the largest graph's ``100 * num_tokens``."""

    name = "stand-in"

    def __init__(self) -> None:
        self.own, self.pool = 0, 0

    def synchronize(self) -> None:
        pass

    def capture(self, num_tokens: int) -> None:
        self.own += 3 + 10 * num_tokens
        self.pool = max(self.pool, 100 * num_tokens)

    def memory_breakdown(self) -> tuple[int, int]:
        return self.own, self.pool

    def memory_in_use(self) -> int:
        return self.own + self.pool


def _capturing_manager(monkeypatch, dispatched: BatchExecutionDescriptor, lazy: bool):
    """A manager with vLLM's plan (``PIECEWISE`` and ``FULL``), whose captures go to a
    ``_Backend`` and are logged, and whose vLLM dispatch returns ``dispatched``; the
    tests call its descriptor capture loop (``NpuGraphsCapture.capture``) directly."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    from npu_vllm_bridge.graphs.counters import GraphCounters

    captured: list = []
    backend = _Backend()
    manager = BridgeModelGraphManager.__new__(BridgeModelGraphManager)
    from npu_vllm_bridge.graphs.full_graphs import FullGraphs

    manager.full = FullGraphs.__new__(FullGraphs)
    manager.full.graphs = SimpleNamespace(backend=backend)
    manager.full.counters = GraphCounters()
    manager.capture_on_first_use = lazy
    manager._capture_descs = {CUDAGraphMode.PIECEWISE: PIECEWISE, CUDAGraphMode.FULL: FULL}
    manager._capture_mem_samples = None
    manager._graphs_captured = False
    manager.graphs = {}
    manager.vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=16)
    )

    def capture_one(create_forward_fn, desc, at_first_use=False) -> None:
        captured.append((create_forward_fn, desc))
        backend.capture(desc.num_tokens)
        if desc.cg_mode == CUDAGraphMode.FULL:
            manager.graphs[desc] = object()

    manager._capture_one = capture_one
    monkeypatch.setattr(CudaGraphManager, "dispatch", lambda self, *args, **kwargs: dispatched)
    return manager, captured


def test_capture_on_first_use_captures_a_full_graph_when_first_dispatched(monkeypatch) -> None:
    desc = FULL[1]
    manager, captured = _capturing_manager(monkeypatch, desc, lazy=True)
    create_forward_fn = object()
    NpuGraphsCapture.capture(manager, create_forward_fn)
    assert captured == [] and manager._graphs_captured  # nothing at start-up
    for _ in range(3):
        assert manager.dispatch(4, 4, 1, 0) is desc
    assert captured == [(create_forward_fn, desc)]  # once, with vLLM's capture inputs
    assert manager.full.counters.eager_steps == 0


def test_start_up_capture_takes_every_descriptor(monkeypatch) -> None:
    manager, captured = _capturing_manager(monkeypatch, FULL[0], lazy=False)
    NpuGraphsCapture.capture(manager, object())
    assert [desc for _, desc in captured] == PIECEWISE + FULL
    manager.dispatch(8, 8, 1, 0)
    assert len(captured) == len(PIECEWISE + FULL)  # nothing more at the first step


def test_steps_without_graphs_are_counted_and_large_decodes_are_off_the_grid(monkeypatch) -> None:
    eager = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=32, num_reqs=32)
    manager, _ = _capturing_manager(monkeypatch, eager, lazy=True)
    NpuGraphsCapture.capture(manager, object())
    manager.dispatch(32, 32, 1, 0)  # a decode larger than the largest graph (16)
    manager.dispatch(2, 32, None, 0)  # a prefill that large runs eagerly by design
    counters = manager.full.counters
    assert (counters.eager_steps, counters.off_grid_steps) == (2, 1), counters


def test_memory_profile_captures_a_sample_and_estimates_every_graph(monkeypatch) -> None:
    manager, captured = _capturing_manager(monkeypatch, FULL[0], lazy=True)
    manager._capture_mem_samples = []  # vLLM's memory profiling
    NpuGraphsCapture.capture(manager, object())
    sampled = [desc.num_tokens for _, desc in captured]
    assert sampled == [16, 1, 8, 2]  # the largest and smallest of each mode
    every_graph = sum(3 + 10 * desc.num_tokens for desc in PIECEWISE + FULL)
    assert manager.profiled_bytes == every_graph + 100 * 16  # own bytes fit exactly, one pool
    assert manager._capture_mem_samples == []  # vLLM's FULL extrapolation gets nothing to add
