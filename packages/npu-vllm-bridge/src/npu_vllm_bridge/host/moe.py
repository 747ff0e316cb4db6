"""Data-parallel MoE layers behind vLLM's opaque ``moe_forward`` op in host mode.

On every platform but the CPU (and TPU), vLLM's MoE runner calls its layer's forward
through the custom ops ``vllm::moe_forward`` / ``vllm::moe_forward_shared``, which
Dynamo sees as one op with a fake implementation. On the CPU it calls the same function
directly, so Dynamo traces the layer's insides. Under data parallelism these gather
every DP rank's tokens and reduce-scatter the expert output back, by token counts that
change every step (vLLM's DP metadata): Dynamo cannot trace them (their sizes are data,
and a traced gather would bake one step's counts into the compiled model), and
micro-batch hand-overs inside them (``micro_batch_collective``) would run at trace time
only. Host mode with data parallelism therefore calls the layers through the custom
ops, as the NPU does: compiled pieces hold one opaque op per MoE layer, whose body runs
eagerly with each step's counts, and host graphs record below it (``npu_graphs``' rule
for custom ops), as they record an eager step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from npu_vllm_bridge.vllm_seam import moe_has_shared_experts, set_moe_forward_entry

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def moe_layers_through_custom_op(vllm_config: VllmConfig) -> int:
    """Make every MoE runner of the loaded model call its forward through vLLM's
    ``moe_forward`` (``moe_forward_shared`` with shared experts) custom op when the
    engine runs data-parallel ranks; returns how many runners were switched."""
    if vllm_config.parallel_config.data_parallel_size <= 1:
        return 0
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    ops = torch.ops.vllm
    layers = vllm_config.compilation_config.static_forward_context.values()
    runners = [layer for layer in layers if isinstance(layer, MoERunner)]
    for runner in runners:
        shared = moe_has_shared_experts(runner)
        set_moe_forward_entry(runner, ops.moe_forward_shared if shared else ops.moe_forward)
    return len(runners)
