"""Host mode calls data-parallel MoE layers through vLLM's opaque ``moe_forward`` ops
(``host/moe.py``), as vLLM does on every platform but the CPU; one rank keeps
vLLM's direct call. The switch itself, on MoE runners made without a model (the DP=2
servers of ``tests-integration/test_vllm_defaults.py`` run it in an engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.fused_moe.runner import moe_runner

from npu_vllm_bridge.host.moe import moe_layers_through_custom_op


def _runner(shared: bool) -> moe_runner.MoERunner:
    runner = object.__new__(moe_runner.MoERunner)  # no layer behind it: only the switch
    runner._shared_experts = object() if shared else None
    runner._forward_entry = moe_runner._moe_forward_shared if shared else moe_runner._moe_forward
    return runner


def _config(dp_size: int, layers: dict) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=dp_size),
        compilation_config=SimpleNamespace(static_forward_context=layers),
    )


def test_data_parallel_moe_layers_go_through_the_custom_ops():
    plain, shared = _runner(shared=False), _runner(shared=True)
    attention = SimpleNamespace(_forward_entry="untouched")  # not a MoE runner
    layers = {"model.layers.0.mlp": plain, "model.layers.1.mlp": shared, "attn": attention}
    assert moe_layers_through_custom_op(_config(2, layers)) == 2
    assert plain._forward_entry is torch.ops.vllm.moe_forward
    assert shared._forward_entry is torch.ops.vllm.moe_forward_shared
    assert attention._forward_entry == "untouched"


def test_one_rank_keeps_the_direct_call():
    plain = _runner(shared=False)
    assert moe_layers_through_custom_op(_config(1, {"mlp": plain})) == 0
    assert plain._forward_entry is moe_runner._moe_forward
