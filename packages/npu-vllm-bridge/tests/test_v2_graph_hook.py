"""The hook that puts the bridge's graph manager into vLLM's Model Runner V2
(``graphs/v2_runner.py``), against a runner that does at those two points what vLLM's V2
``GPUModelRunner`` does: build its manager by the module name, call the model state's
``prepare_attn`` each step."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import vllm.v1.worker.gpu.model_runner as gpu_model_runner
from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

from npu_vllm_bridge.graphs.v2_graphs import BridgeModelGraphManager
from npu_vllm_bridge.graphs.v2_runner import GraphManagerHook


class VllmLikeRunner:
    """vLLM's V2 runner at the two points the hook touches."""

    def __init__(self) -> None:
        self.cudagraph_manager: Any = None
        self.model_state: Any = None
        self.built: type | None = None

    def load_model(self) -> None:
        self.model_state = SimpleNamespace(prepare_attn=lambda *args, **kwargs: {"step": args})

    def initialize_kv_cache(self, kv_cache_config: Any) -> None:
        # vLLM looks the class up by this module name when it builds the manager.
        self.built = gpu_model_runner.ModelCudaGraphManager
        self.cudagraph_manager = self.built.__new__(self.built)


class HookedRunner(GraphManagerHook, VllmLikeRunner):
    pass


def test_the_hook_builds_the_bridges_manager_where_vllm_builds_its_own() -> None:
    runner = HookedRunner()
    runner.initialize_kv_cache(object())
    assert runner.built is BridgeModelGraphManager
    assert gpu_model_runner.ModelCudaGraphManager is ModelCudaGraphManager  # restored


def test_each_steps_metadata_reaches_the_manager() -> None:
    runner = HookedRunner()
    runner.load_model()
    runner.initialize_kv_cache(object())
    metadata = runner.model_state.prepare_attn("batch", 1)
    assert metadata == {"step": ("batch", 1)}
    assert runner.cudagraph_manager.step_attn_metadata is metadata


def test_a_manager_not_the_bridges_is_left_alone() -> None:
    runner = HookedRunner()
    runner.load_model()
    runner.cudagraph_manager = SimpleNamespace()
    runner.model_state.prepare_attn("batch")
    assert not hasattr(runner.cudagraph_manager, "step_attn_metadata")
