"""The bridge's graphs of vLLM V2's EAGLE / MTP drafters on the NPU, against torch_npu's API.

The drafter's graph manager (the bridge's ``BridgeSpeculatorGraphManager``, built by the
name ``SpeculatorCudaGraphManager`` of vLLM's drafter module inside the runner hook, as
the NPU's V2 runner builds it) is captured by vLLM's own
``SpeculatorCudaGraphManager.capture`` over a draft step of two attention layers (the
bridge's attention task on the ascend provider). One proposal then runs two draft steps
back to back, as vLLM's ``_multi_step_decode`` does: each builds its step's metadata
(``_build_attn_metadata``, which the hook hands to the manager) and replays the same
graph. Checked: NPUGraph capture into the platform's pool with a task group per layer
behind its ExternalEvent; each draft step's replay launched before its task update on
the update stream, no synchronize; each step's output equals the reference provider's;
a skipped update is caught. The stand-ins and vLLM set-up are ``v2_manager_steps``'.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils as draft_cudagraph_utils
import vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator as target_dependent_ar
from ascend_cases import max_error
from graph_steps import TOLERANCE
from v2_manager_steps import LAYERS, NUM_REQS, step_metadata, v2_manager_on_the_stand_in
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import AttentionState

import npu_vllm_bridge.graphs.v2_draft_graphs as v2_draft_graphs
from npu_vllm_bridge.attention.tasks import run_attention
from npu_vllm_bridge.graphs.v2_draft_graphs import (
    BridgeSpeculatorGraphManager,
    leave_draft_metadata_with_graphs,
)
from npu_vllm_bridge.graphs.v2_runner import bridge_graph_manager

SYNCHRONIZES = (
    "torch.npu.synchronize",
    "torch.npu.Stream.synchronize",
    "torch.npu.Event.synchronize",
)


class DraftStepSpeculator:
    """vLLM's EAGLE / MTP speculator at the points the bridge touches: it builds its
    draft-step manager by its module's name, captures its draft-step routine (two
    attention layers reading the metadata they are given), builds each step's metadata
    and replays."""

    def __init__(self, steps: list, vllm_config: Any) -> None:
        self.steps = steps
        self.model = torch.nn.Module()  # the drafter whose attention tasks are counted
        with bridge_graph_manager():  # what the hook does around initialize_kv_cache
            self.decode_cudagraph_manager = target_dependent_ar.SpeculatorCudaGraphManager(
                vllm_config, torch.device("cpu"), CUDAGraphMode.FULL_DECODE_ONLY, decode_query_len=1
            )
        (self.desc,) = self.decode_cudagraph_manager._capture_descs[CUDAGraphMode.FULL]
        self.prefill_cudagraph_manager = None
        self.log: Any = None  # the stand-ins' call log
        leave_draft_metadata_with_graphs(self)  # what the hook does after load_model

    def propose(self, input_batch: Any, attn_metadata: Any) -> None:  # pragma: no cover
        raise AssertionError("not called: this test runs draft steps only")

    def _build_attn_metadata(self, step: int) -> dict[str, Any]:
        return step_metadata(self.steps, step)

    def _generate_draft(self, num_reqs, num_tokens, attn_metadata, slot_mappings, *rest, **kw):
        for name, steps in zip(LAYERS, self.steps, strict=True):
            run_attention(
                steps.query, None, None, steps.key_cache, steps.value_cache, steps.out,
                attn_metadata[name], layer_name=name,
            )  # fmt: skip

    def capture(self) -> None:
        """vLLM's ``SpeculatorCudaGraphManager.capture`` of the draft-step routine."""
        buffers = SimpleNamespace()
        self.decode_cudagraph_manager.capture(self._generate_draft, None, buffers, None, [], None)

    def draft_steps(self, steps: tuple[int, ...]) -> list[list[str]]:
        """Draft steps back to back, as ``_multi_step_decode`` runs them: each step's
        queries and K/V, its metadata built, then the replay. Each step's calls."""
        calls = []
        for step in steps:
            for index, layer in enumerate(self.steps):
                layer.query.copy_(layer.write_step(step, generator_seed=10 * step + index))
            self._build_attn_metadata(step)
            start = len(self.log.calls)
            self.decode_cudagraph_manager.run_fullgraph(self.desc)
            calls.append(self.log.calls[start:])
            self.check(step)
        return calls

    def check(self, step: int) -> None:
        for name, layer in zip(LAYERS, self.steps, strict=True):
            assert max_error(layer.out, layer.expected(step)) < TOLERANCE, (name, step)


@pytest.fixture
def drafter(stand_in, monkeypatch):
    with v2_manager_on_the_stand_in(monkeypatch, stand_in.npu) as run:

        def capture_inputs(num_reqs: int, num_tokens: int, *args: Any, **kwargs: Any):
            return AttentionState(step_metadata(run.steps, 1), {})

        # The drafter module's own names of what v2_manager_steps replaces in vLLM's.
        monkeypatch.setattr(draft_cudagraph_utils, "prepare_inputs_to_capture", capture_inputs)
        monkeypatch.setattr(
            v2_draft_graphs, "count_attention_tasks", lambda config, model: len(LAYERS)
        )
        speculator = DraftStepSpeculator(run.steps, run.vllm_config)
        speculator.log = stand_in.log
        yield speculator


def test_the_drafter_manager_captures_npu_graphs_with_a_task_group_per_layer(stand_in, drafter):
    manager = drafter.decode_cudagraph_manager
    assert isinstance(manager, BridgeSpeculatorGraphManager)
    assert drafter.desc.num_reqs == NUM_REQS and drafter.desc.uniform_token_count == 1
    start = len(stand_in.log.calls)
    drafter.capture()
    calls = stand_in.log.calls[start:]
    (capture,) = [call for call in calls if call.name == "torch.npu.graph.__call__"]
    assert capture.arguments["pool"] is manager.pool
    assert capture.arguments["stream"] is manager.full.graphs.stream
    names = [call.name for call in calls]
    assert names.count("torch.npu.graph_task_group_begin") == len(LAYERS)
    assert manager.full.backend.name == "npu" and drafter.desc in manager.graphs
    assert manager.full.tasks.num_tasks(drafter.desc) == len(LAYERS)
    assert not stand_in.npu.runtime.held_replays()
    drafter.check(1)  # the replay right after the capture


def test_each_draft_step_launches_its_replay_before_its_task_update(stand_in, drafter):
    drafter.capture()
    for calls in drafter.draft_steps((2, 3)):
        names = [call.name for call in calls]
        assert not set(SYNCHRONIZES) & set(names)
        assert not stand_in.npu.runtime.held_replays()
        (replay,) = [i for i, name in enumerate(names) if name == "torch.npu.NPUGraph.replay"]
        begins = [i for i, name in enumerate(names) if name == "torch.npu.graph_task_update_begin"]
        assert len(begins) == len(LAYERS) and replay < begins[0]
        update_stream = calls[begins[0]].arguments["stream"]
        assert update_stream is not drafter.decode_cudagraph_manager.full.graphs.stream
        records = [c for c in calls if c.name == "torch.npu.ExternalEvent.record"]
        assert len(records) == len(LAYERS)
        assert all(record.arguments["stream"] is update_stream for record in records)
    assert drafter.decode_cudagraph_manager.step_attn_metadata is None


def test_a_skipped_draft_step_update_is_caught(stand_in, drafter, monkeypatch):
    drafter.capture()
    tasks = drafter.decode_cudagraph_manager.full.tasks
    monkeypatch.setattr(type(tasks), "update", lambda self, key, step: None)
    monkeypatch.setattr(DraftStepSpeculator, "check", lambda self, step: None)
    drafter.draft_steps((2,))
    assert not stand_in.npu.runtime.held_replays()  # released, not hung
    for layer in drafter.steps:
        assert max_error(layer.out, layer.expected(2)) > 10 * TOLERANCE  # step 1's lengths
