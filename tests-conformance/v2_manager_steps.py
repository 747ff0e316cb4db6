"""The bridge's V2 graph manager on the stand-in NPU, driven as vLLM's Model Runner V2 drives it.

* The model: two attention layers, each the bridge's attention task
  (``npu_vllm_bridge.attention.tasks.run_attention``, a task named after its layer)
  over the ascend provider, one :class:`~graph_steps.Steps` (cache, query, output) per
  layer. Its FULL graph records one task group per layer.
* The manager is built by the name vLLM's V2 ``initialize_kv_cache`` looks up, inside
  the bridge's hook (``graphs/v2_runner.py``), and captured by vLLM's own
  ``ModelCudaGraphManager.capture`` (its capture inputs, forward context and persistent
  outputs; the capture inputs' attention metadata is step 1's plans, one per layer).
* A step hands the manager its per-layer metadata through the model state's
  ``prepare_attn``, as the hook leaves it, then ``run_fullgraph`` replays.

What vLLM needs a GPU or a loaded model for is replaced, and only that: the pipeline
group (one rank), the platform's graph pool and bridge settings (the NPU platform's),
``prepare_inputs_to_capture`` (the steps' metadata), and the count of attention layers
(vLLM counts its own ``Attention`` modules; these layers are not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import vllm.v1.worker.gpu.cudagraph_utils as cudagraph_utils
import vllm.v1.worker.gpu.model_runner as gpu_model_runner
from graph_steps import Steps
from vllm.config import CUDAGraphMode, SchedulerConfig, VllmConfig
from vllm.forward_context import get_forward_context

import npu_graphs.wrapper as npu_graphs_wrapper
import npu_vllm_bridge.graphs.v2_graphs as v2_graphs
from npu_graphs import register_backend
from npu_graphs.backends.npu import NpuGraphBackend
from npu_vllm_bridge.attention.tasks import run_attention
from npu_vllm_bridge.graphs.v2_runner import bridge_graph_manager, leave_attn_metadata_with_graphs
from npu_vllm_bridge.settings import BridgeSettings

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
# The NPU platform's settings (platforms/npu.py, whose import needs an NPU).
NPU_SETTINGS = BridgeSettings(
    attention_provider="ascend", kv_cache_split="planes", graph_backend="npu"
)
NUM_REQS = 3  # graph_steps' batch: three decode requests


class TwoAttentionLayers(torch.nn.Module):
    """Two attention layers reading their metadata from vLLM's forward context."""

    def __init__(self, steps: list[Steps]) -> None:
        super().__init__()
        self.steps = steps

    def forward(self, input_ids: Any, positions: Any, intermediate_tensors: Any = None, **_: Any):
        attn_metadata = get_forward_context().attn_metadata
        for name, steps in zip(LAYERS, self.steps, strict=True):
            run_attention(
                steps.query,
                None,
                None,
                steps.key_cache,
                steps.value_cache,
                steps.out,
                attn_metadata[name],
                layer_name=name,
            )
        return self.steps[-1].out  # the hidden states vLLM keeps in its persistent buffer


def step_metadata(steps: list[Steps], step: int) -> dict[str, Any]:
    """``{layer_name: attn_metadata}`` of step ``step``: each layer's plan."""
    return {name: SimpleNamespace(plan=s.plan(step)) for name, s in zip(LAYERS, steps, strict=True)}


class V2Run:
    """A captured V2 manager, its model's layers, and a runner stand-in whose model
    state's ``prepare_attn`` the bridge's hook wraps."""

    def __init__(self) -> None:
        self.steps = [Steps(), Steps()]
        self.model = TwoAttentionLayers(self.steps)
        self.vllm_config = _vllm_config()
        with bridge_graph_manager():  # what the hook does around vLLM's initialize_kv_cache
            self.manager = gpu_model_runner.ModelCudaGraphManager(
                self.vllm_config,
                torch.device("cpu"),
                CUDAGraphMode.FULL_DECODE_ONLY,
                decode_query_len=1,
            )
        (self.desc,) = self.manager._capture_descs[CUDAGraphMode.FULL]
        self._next: dict[str, Any] | None = None
        self.runner = SimpleNamespace(
            model_state=SimpleNamespace(prepare_attn=lambda *args, **kwargs: self._next),
            cudagraph_manager=self.manager,
        )
        leave_attn_metadata_with_graphs(self.runner)  # what the hook does after load_model

    def capture(self) -> None:
        """vLLM's ``ModelCudaGraphManager.capture`` with step 1's metadata."""
        buffers = SimpleNamespace(
            input_ids=torch.zeros(NUM_REQS, dtype=torch.int64),
            positions=torch.zeros(NUM_REQS, dtype=torch.int64),
            is_padding=torch.zeros(NUM_REQS, dtype=torch.bool),
        )
        model_state = SimpleNamespace(prepare_dummy_inputs=lambda num_reqs, num_tokens: {})
        self.manager.capture(self.model, model_state, buffers, None, None, [], None)

    def step(self, step: int) -> None:
        """Step ``step``: new K/V and queries per layer, its metadata through
        ``prepare_attn``, then the FULL replay."""
        for index, steps in enumerate(self.steps):
            steps.query.copy_(steps.write_step(step, generator_seed=10 * step + index))
        self._next = step_metadata(self.steps, step)
        self.runner.model_state.prepare_attn("input batch")
        self.manager.run_fullgraph(self.desc)


def _vllm_config() -> VllmConfig:
    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=NUM_REQS,
            max_num_batched_tokens=64,
            max_model_len=512,
            is_encoder_decoder=False,
        )
    )
    # Set after VllmConfig's checks (the CPU platform empties the capture sizes).
    config.compilation_config.cudagraph_capture_sizes = [NUM_REQS]
    config.compilation_config.max_cudagraph_capture_size = NUM_REQS
    return config


@contextlib.contextmanager
def v2_manager_on_the_stand_in(monkeypatch: Any, npu: Any) -> Iterator[V2Run]:
    """vLLM's V2 manager set up as on an NPU (see the module doc); a fresh ``npu``
    graph backend of npu-graphs for this test."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    monkeypatch.setattr(platform, "bridge_settings", NPU_SETTINGS, raising=False)
    monkeypatch.setattr(platform, "_global_graph_pool", npu.graph_pool_handle())
    monkeypatch.setattr(
        cudagraph_utils,
        "get_pp_group",
        lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True),
    )
    monkeypatch.setattr(v2_graphs, "count_attention_tasks", lambda config, model: len(LAYERS))
    monkeypatch.setattr(npu_graphs_wrapper, "_POOLS", {})
    monkeypatch.setattr(npu_graphs_wrapper, "_CAPTURE_STREAMS", {})
    run: V2Run | None = None

    def capture_inputs(num_reqs: int, num_tokens: int, *args: Any, **kwargs: Any):
        assert run is not None
        return cudagraph_utils.AttentionState(step_metadata(run.steps, 1), {})

    monkeypatch.setattr(cudagraph_utils, "prepare_inputs_to_capture", capture_inputs)
    register_backend("npu", NpuGraphBackend)  # a backend of this test's stand-in
    try:
        run = V2Run()
        yield run
    finally:
        register_backend("npu", NpuGraphBackend)  # drops it
