"""The DCP capture batch's dummy keys are written nowhere.

vLLM 0.32 fills a DCP capture batch (``prepare_dcp_dummy_context_metadata``) with one
block-table row and one context length for every dummy request, so its slot mapping names
one slot for several tokens; ``npu_scatter_pa_kv_cache`` takes distinct slots. The
bridge's builders plan that batch with every slot ``-1`` (padding), as vLLM's other dummy
runs are; without DCP the capture batch's slots are left as vLLM gave them.
"""

from __future__ import annotations

import types

import torch

from npu_vllm_bridge.attention.builder import BridgeBuilderBase
from npu_vllm_bridge.attention.context_parallel import DCPLayout


def _capture_slots(dcp: DCPLayout | None, slots: list[int]) -> list[int]:
    """The slot mapping the builder plans a capture batch with."""
    seen = {}
    builder = types.SimpleNamespace(
        dcp=dcp,
        step_lengths=lambda cm, for_capture: for_capture,
        plan_step=lambda cm, lengths: seen.setdefault("slots", cm.slot_mapping.tolist()),
    )
    cm = types.SimpleNamespace(slot_mapping=torch.tensor(slots, dtype=torch.int64))
    BridgeBuilderBase.build_for_cudagraph_capture(builder, cm)
    return seen["slots"]


def test_dcp_capture_batch_slots_become_padding():
    # rank 0's slots of vLLM's DCP capture batch of 4 requests at TP=2, DCP=2: all one slot
    assert _capture_slots(DCPLayout(2, 0), [129, 129, 129, 129]) == [-1, -1, -1, -1]


def test_capture_batch_slots_without_dcp_are_kept():
    assert _capture_slots(None, [-1, -1, 5, 6]) == [-1, -1, 5, 6]
