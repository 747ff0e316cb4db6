"""The V2 graph manager's FULL replay (``graphs/v2_graphs.py``); capture and replay
inside vLLM are exercised by tests-integration/test_v2_host_mode.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

from npu_vllm_bridge.graphs.v2_graphs import BridgeModelGraphManager

DESC = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=4, num_reqs=4)


def _manager(calls: list, num_tasks: int = 2) -> BridgeModelGraphManager:
    """A manager with stand-ins for its task registry and graph wrapper (no capture);
    the wrapper's ``replay_with_update`` runs the update, then logs the replay (the order
    each graph backend takes is npu-graphs' own, tested there and in tests-conformance)."""
    manager = BridgeModelGraphManager.__new__(BridgeModelGraphManager)
    manager.tasks = SimpleNamespace(
        num_tasks=lambda desc: num_tasks, update=lambda desc, step: calls.append(("update", step))
    )

    def replay_with_update(desc, update) -> None:
        update()
        calls.append(("replay_with_update", desc))

    manager.wrapper = SimpleNamespace(
        replay=lambda desc: calls.append(("replay", desc)), replay_with_update=replay_with_update
    )
    manager.is_last_pp_rank, manager.use_aux_hidden_state_outputs = True, False
    manager.hidden_states = torch.arange(8.0)[:, None]  # vLLM's persistent output buffer
    return manager


def test_replay_hands_the_wrapper_an_update_with_the_steps_metadata() -> None:
    calls: list = []
    manager = _manager(calls)
    step = {"model.layers.0.self_attn.attn": object(), "model.layers.1.self_attn.attn": object()}
    manager.step_attn_metadata = step
    hidden_states = manager.run_fullgraph(DESC)
    assert calls == [("update", step), ("replay_with_update", DESC)]
    assert torch.equal(hidden_states, manager.hidden_states[:4])  # vLLM's output slicing
    assert manager.step_attn_metadata is None  # one step's metadata serves one replay


def test_a_graph_without_tasks_replays_without_update() -> None:
    calls: list = []
    manager = _manager(calls, num_tasks=0)
    manager.step_attn_metadata = {}
    manager.run_fullgraph(DESC)
    assert calls == [("replay", DESC)]


def test_replay_without_the_steps_metadata_is_refused() -> None:
    manager = _manager([])
    with pytest.raises(ValueError, match="without the step's attention metadata"):
        manager.run_fullgraph(DESC)
