"""npu-graphs graphs of vLLM's Model Runner V2 drafters (EAGLE, MTP), through its
``SpeculatorCudaGraphManager``.

V2's drafters that draft from the target's hidden states (``spec_decode/target_dependent_ar``:
EAGLE, EAGLE-3, MTP; ``spec_decode/multi_module_mtp``) capture whole routines of their
own, not only the model forward: the draft model, its logits, the draft token's
sampling and, for draft steps, the next step's inputs. Their manager,
``SpeculatorCudaGraphManager`` (a ``CudaGraphManager``), hard-codes
``torch.cuda.CUDAGraph`` as the target's does, and its FULL replays run with no forward
context:

* the draft prefill (``prefill_cudagraph_manager``): the first draft pass over the
  verify step's ``1 + k`` tokens per request, graphs of the target's mode; it replays
  with the target step's attention metadata, which ``propose`` gets (the drafter's
  layers are in it);
* the draft decode (``decode_cudagraph_manager``): one draft step of one token per
  request, FULL_DECODE_ONLY, replayed once per draft step after the speculator built
  that step's metadata (``_build_attn_metadata``);
* multi-module MTP (``cudagraph_manager``): all its modules in one graph, replayed
  with the metadata the speculator built for the proposal.

:class:`BridgeSpeculatorGraphManager` keeps vLLM's manager (its descriptors, the dummy
inputs and metadata it builds for each capture, ``specialize_spec_tokens``) and
captures through the target's capture loop
(:class:`~npu_vllm_bridge.graphs.v2_graphs.NpuGraphsCapture`) into a graph component of
its own (:class:`~npu_vllm_bridge.graphs.full_graphs.FullGraphs`, role ``DRAFTER``: its
own task registry, its replays counted as the drafter's). It captures at start-up, also where the target's graphs are
captured at first use (``capture_on_first_use``): a drafter dispatches after its step
has filled the persistent buffers that a capture's dummy forward writes (input ids,
positions, hidden states, draft tokens), so a capture at that point would overwrite
the step. The runner hook (``graphs/v2_runner.py``) installs the class and hands each
manager the metadata of its next replay (:func:`leave_draft_metadata_with_graphs`).

Counted apart from the target's graphs, in the drafter's graph component's counters
(``full.counters``; the runner sums them with the target's): ``draft_captured`` (also
in ``captured``), ``draft_replayed_steps``, ``draft_task_updates``, and here
``draft_other_forwards`` (dispatches to PIECEWISE or eager).
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import (
    SpeculatorCudaGraphManager,
)

from npu_vllm_bridge import vllm_seam
from npu_vllm_bridge.attention.tasks import count_attention_tasks
from npu_vllm_bridge.graphs.full_graphs import DRAFTER
from npu_vllm_bridge.graphs.v2_graphs import NpuGraphsCapture

# The speculator attributes that hold its graph managers, by where their replays'
# metadata comes from: the target step's (``propose``'s argument), or the
# speculator's own (``_build_attn_metadata``).
TARGET_METADATA_MANAGERS = ("prefill_cudagraph_manager",)
OWN_METADATA_MANAGERS = ("decode_cudagraph_manager", "cudagraph_manager")
DRAFT_MANAGERS = TARGET_METADATA_MANAGERS + OWN_METADATA_MANAGERS


class BridgeSpeculatorGraphManager(SpeculatorCudaGraphManager, NpuGraphsCapture):
    """vLLM's ``SpeculatorCudaGraphManager`` whose graphs are npu-graphs graphs."""

    captured_bytes: int = 0  # what its capture took (the graph backend's accounting)

    def capture(self, forward_fn: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM's drafter capture (``SpeculatorCudaGraphManager.capture``'s arguments),
        every descriptor at start-up; each FULL graph must record one attention task
        per attention layer of the drafter whose routine ``forward_fn`` is (vLLM
        passes the speculator's bound method)."""
        if self.use_breakable_cg:
            raise NotImplementedError(
                "VLLM_USE_BREAKABLE_CUDAGRAPH: breakable CUDA graphs are torch.cuda graphs; "
                "the bridge captures the drafter's PIECEWISE graphs through vLLM's compiled pieces"
            )
        speculator = getattr(forward_fn, "__self__", None)
        model = getattr(speculator, "model", None)
        expected = None if model is None else count_attention_tasks(self.vllm_config, model)
        name = getattr(forward_fn, "__name__", "draft").lstrip("_")
        self.set_up_graphs(
            f"{type(model).__name__}.{name}[FULL]",
            expected,
            role=DRAFTER,
            task_label=f"draft attention ({name})",
        )
        self.capture_on_first_use = False
        backend = self.full.backend
        before = backend.memory_in_use()
        super().capture(forward_fn, *args, **kwargs)
        self.captured_bytes = backend.memory_in_use() - before

    def _count_dispatch(
        self, desc: BatchExecutionDescriptor, num_tokens: int, uniform_token_count: int | None
    ) -> None:
        if desc.cg_mode != CUDAGraphMode.FULL:
            self.full.counters.draft_other_forwards += 1


def draft_graph_managers(speculator: Any) -> list[BridgeSpeculatorGraphManager]:
    """``speculator``'s bridge graph managers (none without a speculator)."""
    managers = (getattr(speculator, name, None) for name in DRAFT_MANAGERS)
    return [m for m in managers if isinstance(m, BridgeSpeculatorGraphManager)]


def drafter_graph_bytes(speculator: Any) -> int:
    """What the captures of ``speculator``'s bridge graph managers took (0 without
    a speculator)."""
    return sum(m.captured_bytes for m in draft_graph_managers(speculator))


def leave_draft_metadata_with_graphs(speculator: Any) -> None:
    """Make ``speculator`` hand each of its bridge graph managers the attention
    metadata of its next FULL replay: ``propose``'s ``attn_metadata`` (the target
    step's) to the draft prefill's, each metadata from ``_build_attn_metadata`` (a
    draft step's, or multi-module MTP's proposal's) to the others. Both are instance
    patches through ``vllm_seam``; a speculator without them is left alone."""
    entries = (vllm_seam.V2_SPECULATOR_PROPOSE, vllm_seam.V2_SPECULATOR_BUILD_ATTN_METADATA)
    if not all(callable(vllm_seam.get_attribute(speculator, e, None)) for e in entries):
        return

    def leaving_target_metadata(propose: Any) -> Any:
        signature = inspect.signature(propose)

        def propose_leaving_metadata(*args: Any, **kwargs: Any) -> Any:
            attn_metadata = signature.bind(*args, **kwargs).arguments["attn_metadata"]
            _leave(speculator, TARGET_METADATA_MANAGERS, attn_metadata)
            return propose(*args, **kwargs)

        return propose_leaving_metadata

    def leaving_own_metadata(build: Any) -> Any:
        def build_leaving_metadata(*args: Any, **kwargs: Any) -> Any:
            attn_metadata = build(*args, **kwargs)
            _leave(speculator, OWN_METADATA_MANAGERS, attn_metadata)
            return attn_metadata

        return build_leaving_metadata

    vllm_seam.wrap_instance_method(speculator, entries[0], leaving_target_metadata)
    vllm_seam.wrap_instance_method(speculator, entries[1], leaving_own_metadata)


def _leave(speculator: Any, names: tuple[str, ...], attn_metadata: Any) -> None:
    for name in names:
        manager = getattr(speculator, name, None)
        if isinstance(manager, BridgeSpeculatorGraphManager):
            manager.step_attn_metadata = attn_metadata
