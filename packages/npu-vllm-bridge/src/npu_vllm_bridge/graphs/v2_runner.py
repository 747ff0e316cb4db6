"""The bridge's graph manager inside a vLLM Model Runner V2 (host and NPU runners).

vLLM's V2 ``GPUModelRunner`` builds its graph manager in ``initialize_kv_cache`` by the
name ``ModelCudaGraphManager`` of ``vllm.v1.worker.gpu.model_runner``, and replays FULL
graphs (``run_fullgraph``) with no forward context. :class:`GraphManagerHook`, mixed in
before a V2 runner class, touches those two points and nothing else:

* ``initialize_kv_cache``: while vLLM's runs, that module name means
  :class:`~npu_vllm_bridge.graphs.v2_graphs.BridgeModelGraphManager`
  (:func:`bridge_graph_manager`);
* ``load_model``: the model state's ``prepare_attn`` (an instance attribute over vLLM's
  method) leaves each step's attention metadata with that manager, whose FULL replays
  update the attention tasks with it (:func:`leave_attn_metadata_with_graphs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import vllm.v1.worker.gpu.model_runner as gpu_model_runner

from npu_vllm_bridge.graphs.v2_graphs import BridgeModelGraphManager


class GraphManagerHook:
    """Mixin for a V2 ``GPUModelRunner`` subclass: the bridge's graph manager."""

    model_state: Any
    cudagraph_manager: Any

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        leave_attn_metadata_with_graphs(self)

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's, building the bridge's graph manager."""
        with bridge_graph_manager():
            super().initialize_kv_cache(*args, **kwargs)  # type: ignore[misc]


@contextlib.contextmanager
def bridge_graph_manager() -> Iterator[None]:
    """In the enclosed block, vLLM's V2 runner builds a :class:`BridgeModelGraphManager`."""
    with mock.patch.object(gpu_model_runner, "ModelCudaGraphManager", BridgeModelGraphManager):
        yield


def leave_attn_metadata_with_graphs(runner: Any) -> None:
    """Make ``runner.model_state.prepare_attn`` hand each step's metadata to the runner's
    graph manager (when it is the bridge's) as it returns it."""
    prepare_attn = runner.model_state.prepare_attn

    def prepare_attn_for_replay(*args: Any, **kwargs: Any) -> Any:
        attn_metadata = prepare_attn(*args, **kwargs)
        manager = runner.cudagraph_manager
        if isinstance(manager, BridgeModelGraphManager):
            manager.step_attn_metadata = attn_metadata
        return attn_metadata

    runner.model_state.prepare_attn = prepare_attn_for_replay
