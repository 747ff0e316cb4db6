"""The bridge's graph managers for vLLM V2's EAGLE / MTP drafters
(``graphs/v2_draft_graphs.py``) and how the runner hook puts them in
(``graphs/v2_runner.py``), against a runner and speculator that do at those points what
vLLM's do: the speculator builds its managers by its module's name
``SpeculatorCudaGraphManager`` in ``init_cudagraph_manager`` (from the runner's
``initialize_kv_cache``), replays its draft prefill after ``propose`` got the target
step's metadata, and each draft step after building that step's metadata. Capture and
replay inside vLLM are exercised by tests-integration/test_v2_spec_decode.py."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator as multi_module_mtp
import vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator as target_dependent_ar
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import (
    SpeculatorCudaGraphManager,
)

from npu_vllm_bridge.graphs.full_graphs import DRAFTER, FullGraphs
from npu_vllm_bridge.graphs.v2_draft_graphs import (
    BridgeSpeculatorGraphManager,
    drafter_graph_bytes,
)
from npu_vllm_bridge.graphs.v2_runner import GraphManagerHook

DESC = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=3, num_reqs=3)


class VllmLikeSpeculator:
    """An EAGLE / MTP speculator at the points the hook touches."""

    def __init__(self) -> None:
        self.prefill_cudagraph_manager: Any = None
        self.decode_cudagraph_manager: Any = None
        self.built: list[type] = []

    def init_cudagraph_manager(self) -> None:
        for name, module in (("prefill", target_dependent_ar), ("decode", multi_module_mtp)):
            cls = module.SpeculatorCudaGraphManager  # vLLM looks it up by this name
            self.built.append(cls)
            setattr(self, f"{name}_cudagraph_manager", _manager(cls))

    def propose(self, input_batch: Any, attn_metadata: Any, *rest: Any, **options: Any) -> str:
        return "drafts"

    def _build_attn_metadata(self, num_reqs: int, step: int) -> dict:
        return {"draft layer": (num_reqs, step)}


class VllmLikeRunner:
    def __init__(self) -> None:
        self.speculator = VllmLikeSpeculator()
        self.model_state: Any = None
        self.cudagraph_manager: Any = None

    def load_model(self) -> None:
        self.model_state = SimpleNamespace(prepare_attn=lambda *args: {"target": args})

    def initialize_kv_cache(self, kv_cache_config: Any) -> None:
        self.speculator.init_cudagraph_manager()


class HookedRunner(GraphManagerHook, VllmLikeRunner):
    pass


def _manager(cls: type) -> Any:
    """A manager of ``cls`` without vLLM's set-up."""
    return cls.__new__(cls)


def _hooked_runner() -> HookedRunner:
    runner = HookedRunner()
    runner.load_model()
    runner.initialize_kv_cache(object())
    return runner


def test_the_drafters_build_the_bridges_managers_while_the_kv_cache_is_set_up() -> None:
    runner = _hooked_runner()
    assert runner.speculator.built == [BridgeSpeculatorGraphManager] * 2
    for module in (target_dependent_ar, multi_module_mtp):  # restored after
        assert module.SpeculatorCudaGraphManager is SpeculatorCudaGraphManager


def test_draft_prefill_gets_the_target_steps_metadata_from_propose() -> None:
    speculator = _hooked_runner().speculator
    prefill, decode = speculator.prefill_cudagraph_manager, speculator.decode_cudagraph_manager
    target_step = {"target": 1}
    assert speculator.propose("batch", target_step, "slots") == "drafts"
    assert prefill.step_attn_metadata is target_step
    assert decode.step_attn_metadata is None
    speculator.propose(input_batch="batch", attn_metadata={"target": 2})  # vLLM's dummy run
    assert prefill.step_attn_metadata == {"target": 2}


def test_each_draft_step_gets_the_metadata_the_speculator_built_for_it() -> None:
    speculator = _hooked_runner().speculator
    prefill, decode = speculator.prefill_cudagraph_manager, speculator.decode_cudagraph_manager
    for step in (1, 2):
        built = speculator._build_attn_metadata(3, step=step)
        assert decode.step_attn_metadata is built == {"draft layer": (3, step)}
    assert prefill.step_attn_metadata is None


def test_the_names_the_hook_reads_are_vllms() -> None:
    """vLLM may rename what the hand-over reads: ``propose``'s ``attn_metadata`` and
    ``_build_attn_metadata``, the manager attributes, ``SpeculatorCudaGraphManager``."""
    from vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator import (
        MultiModuleMTPSpeculator,
    )
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (
        TargetDependentARSpeculator,
    )

    for cls in (TargetDependentARSpeculator, MultiModuleMTPSpeculator):
        assert "attn_metadata" in inspect.signature(cls.propose).parameters
        assert callable(cls._build_attn_metadata)
        source = inspect.getsource(cls)
        assert "SpeculatorCudaGraphManager(" in source
    assert "self.prefill_cudagraph_manager.run_fullgraph" in inspect.getsource(
        TargetDependentARSpeculator.propose
    )
    assert "self.decode_cudagraph_manager.run_fullgraph" in inspect.getsource(
        TargetDependentARSpeculator._multi_step_decode
    )
    assert "self.cudagraph_manager.run_fullgraph" in inspect.getsource(
        MultiModuleMTPSpeculator.propose
    )


def test_a_draft_replay_runs_the_drafters_graph_and_counts_apart_from_the_target() -> None:
    """The manager's graph component (a host graph of ``2 * buffer``, the drafter's
    role) replays with the step's metadata left for it, once per metadata: its output
    follows the buffer as eager would, and the replay counts as the drafter's."""
    buffer = torch.ones(3)
    manager = _manager(BridgeSpeculatorGraphManager)
    manager.full = FullGraphs(
        lambda: buffer * 2, name="draft", expected_tasks=0, role=DRAFTER, backend="host"
    )
    manager.full.capture(DESC)
    buffer.copy_(torch.tensor([1.0, 2.0, 3.0]))
    manager.step_attn_metadata = {"draft layer": object()}
    outputs = manager.full.replay(DESC, manager.step_attn_metadata)
    manager.step_attn_metadata = {"draft layer": object()}
    manager.run_fullgraph(DESC)
    assert manager.step_attn_metadata is None  # one metadata serves one replay
    torch.testing.assert_close(outputs, buffer * 2, rtol=0, atol=0)
    counters = manager.full.counters
    assert (counters.draft_captured, counters.draft_replayed_steps) == (1, 2)
    assert (counters.replayed_steps, counters.task_updates) == (0, 0)
    assert counters.captured == 1  # the drafter's captures are also in ``captured``
    with pytest.raises(ValueError, match="without the step's attention metadata"):
        manager.run_fullgraph(DESC)


def test_drafter_graph_bytes_add_up_its_managers() -> None:
    speculator = VllmLikeSpeculator()
    assert drafter_graph_bytes(speculator) == drafter_graph_bytes(None) == 0
    speculator.prefill_cudagraph_manager = _manager(BridgeSpeculatorGraphManager)
    speculator.decode_cudagraph_manager = _manager(BridgeSpeculatorGraphManager)
    speculator.prefill_cudagraph_manager.captured_bytes = 100
    speculator.decode_cudagraph_manager.captured_bytes = 20
    assert drafter_graph_bytes(speculator) == 120
