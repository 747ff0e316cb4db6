"""The bridge's graph manager inside a vLLM Model Runner V2 (host and NPU runners).

vLLM's V2 ``GPUModelRunner`` builds its graph manager in ``initialize_kv_cache`` by the
name ``ModelCudaGraphManager`` of ``vllm.v1.worker.gpu.model_runner``, and replays FULL
graphs (``run_fullgraph``) with no forward context. :class:`GraphManagerHook`, mixed in
before a V2 runner class, touches those two points and nothing else:

* ``initialize_kv_cache``: while vLLM's runs, that module name means
  :class:`~npu_vllm_bridge.graphs.v2_graphs.BridgeModelGraphManager`, and the name
  ``SpeculatorCudaGraphManager`` of the EAGLE / MTP drafters' modules
  (``spec_decode.target_dependent_ar.speculator``, ``spec_decode.multi_module_mtp.speculator``),
  by which their ``init_cudagraph_manager`` builds theirs, means
  :class:`~npu_vllm_bridge.graphs.v2_draft_graphs.BridgeSpeculatorGraphManager`
  (:func:`bridge_graph_manager`); with micro-batch overlap, the name ``UBatchRunner``
  of ``vllm.v1.worker.gpu.ubatch_utils``, by which ``maybe_build_ubatch_runner`` builds
  the micro-batch runner, means :class:`~npu_vllm_bridge.graphs.v2_ubatch.BridgeUBatchRunner`;
* ``load_model``: the model state's ``prepare_attn`` (an instance attribute over vLLM's
  method) leaves each step's attention metadata with that manager, whose FULL replays
  update the attention tasks with it (:func:`leave_attn_metadata_with_graphs`); the
  speculator's ``propose`` and ``_build_attn_metadata`` (instance attributes too) leave
  the metadata of each drafter replay with the drafter's managers
  (:func:`~npu_vllm_bridge.graphs.v2_draft_graphs.leave_draft_metadata_with_graphs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp

from npu_vllm_bridge.graphs.counters import GraphCounters, RunnerCounters
from npu_vllm_bridge.graphs.v2_draft_graphs import (
    BridgeSpeculatorGraphManager,
    draft_graph_managers,
    leave_draft_metadata_with_graphs,
)
from npu_vllm_bridge.graphs.v2_graphs import BridgeModelGraphManager, NpuGraphsCapture
from npu_vllm_bridge.graphs.v2_ubatch import BridgeUBatchRunner
from npu_vllm_bridge.graphs.wrapper import wrappers_of
from npu_vllm_bridge.vllm_seam import (
    V2_DISPATCH_CG_AND_SYNC_DP,
    V2_MODEL_GRAPH_MANAGER,
    V2_MODEL_STATE_PREPARE_ATTN,
    V2_MTP_SPECULATOR_GRAPH_MANAGER,
    V2_TDAR_SPECULATOR_GRAPH_MANAGER,
    V2_UBATCH_RUNNER,
    swap_module_attribute,
    wrap_instance_method,
)

# The names by which the EAGLE / MTP drafters' modules build a drafter's managers.
DRAFTER_MANAGERS = (V2_TDAR_SPECULATOR_GRAPH_MANAGER, V2_MTP_SPECULATOR_GRAPH_MANAGER)


class GraphManagerHook(RunnerCounters):
    """Mixin for a V2 ``GPUModelRunner`` subclass: the bridge's graph manager, and
    ``graph_counters()`` summing what its graph components counted."""

    vllm_config: Any
    model_state: Any
    cudagraph_manager: Any

    def graph_component_counters(self) -> list[GraphCounters]:
        """The counters of the graph components of this runner: its graph manager's
        (FULL graphs, dispatches without graphs), its drafter's managers', the
        PIECEWISE pieces' (and any other graph wrapper of this engine's)."""
        managers = [getattr(self, "cudagraph_manager", None)]
        managers += draft_graph_managers(getattr(self, "speculator", None))
        parts = [
            manager.full.counters
            for manager in managers
            if isinstance(manager, NpuGraphsCapture) and manager.full is not None
        ]
        parts += [wrapper.counters for wrapper in wrappers_of(self.vllm_config)]
        return list({id(counters): counters for counters in parts}.values())  # each once

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        leave_attn_metadata_with_graphs(self)
        speculator = getattr(self, "speculator", None)
        if speculator is not None:
            leave_draft_metadata_with_graphs(speculator)

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's, building the bridge's graph manager."""
        with bridge_graph_manager():
            super().initialize_kv_cache(*args, **kwargs)  # type: ignore[misc]

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's, its dispatch agreed across DP ranks before a graph is captured
        (:func:`dispatch_then_capture`)."""
        with swap_module_attribute(V2_DISPATCH_CG_AND_SYNC_DP, dispatch_then_capture):
            return super().execute_model(*args, **kwargs)  # type: ignore[misc]


def dispatch_then_capture(
    cudagraph_manager: Any,
    num_reqs: int,
    num_tokens: int,
    uniform_token_count: int | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """vLLM's ``dispatch_cg_and_sync_dp`` (its arguments and result), through the bridge's
    manager's ``dispatch_agreed``: a FULL graph is captured at first use once the DP
    ranks agreed on its descriptor, on all of them."""

    def agreement() -> Any:
        return dispatch_cg_and_sync_dp(
            cudagraph_manager, num_reqs, num_tokens, uniform_token_count, *args, **kwargs
        )

    if not isinstance(cudagraph_manager, NpuGraphsCapture):
        return agreement()
    return cudagraph_manager.dispatch_agreed(agreement, num_tokens, uniform_token_count)


@contextlib.contextmanager
def bridge_graph_manager() -> Iterator[None]:
    """In the enclosed block, vLLM's V2 runner builds a :class:`BridgeModelGraphManager`
    and, with micro-batch overlap, a :class:`BridgeUBatchRunner`; its EAGLE / MTP
    drafters build :class:`BridgeSpeculatorGraphManager` s."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(swap_module_attribute(V2_MODEL_GRAPH_MANAGER, BridgeModelGraphManager))
        stack.enter_context(swap_module_attribute(V2_UBATCH_RUNNER, BridgeUBatchRunner))
        for entry in DRAFTER_MANAGERS:
            stack.enter_context(swap_module_attribute(entry, BridgeSpeculatorGraphManager))
        yield


def leave_attn_metadata_with_graphs(runner: Any) -> None:
    """Make ``runner.model_state.prepare_attn`` hand each step's metadata to the runner's
    graph manager (when it is the bridge's) as it returns it."""

    def leaving(prepare_attn: Any) -> Any:
        def prepare_attn_for_replay(*args: Any, **kwargs: Any) -> Any:
            attn_metadata = prepare_attn(*args, **kwargs)
            manager = runner.cudagraph_manager
            if isinstance(manager, BridgeModelGraphManager):
                manager.step_attn_metadata = attn_metadata
            return attn_metadata

        return prepare_attn_for_replay

    wrap_instance_method(runner.model_state, V2_MODEL_STATE_PREPARE_ATTN, leaving)
