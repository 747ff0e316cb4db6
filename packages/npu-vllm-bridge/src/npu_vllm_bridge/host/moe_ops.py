"""PyTorch versions of vLLM's compiled CPU MoE kernels, for a vLLM built without them.

vLLM's CPU MoE experts (``CPUUnquantizedExperts``) prepack each layer's expert weights
once (``torch.ops._C.prepack_moe_weight``) and run the experts with
``torch.ops._C.cpu_fused_moe``. ``compiled_ops`` defines these two under their own
names where ``vllm._C`` does not exist. The pair agrees on its own layout: "prepacking"
copies the weights as they are, and the experts read them so. (The compiled kernels use
a blocked layout of their own; their pair gives the same expert output.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# vLLM's MoEActivation values the CPU kernel takes for gated experts: act(gate) * up,
# with w13's rows [gate; up].
_GATED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def prepack_moe_weight(weight: torch.Tensor, packed_weight: torch.Tensor, isa: str) -> None:
    """Write ``weight [experts, rows, cols]`` into ``packed_weight`` (same shape and dtype)
    in :func:`cpu_fused_moe`'s layout (the weight's own); ``isa`` is vLLM's kernel choice
    (``"vec"`` / ``"amx"``), the same layout for both here."""
    if packed_weight.shape != weight.shape or packed_weight.dtype != weight.dtype:
        raise ValueError(
            "prepack_moe_weight takes an output of the weight's shape and dtype, got "
            f"{tuple(packed_weight.shape)} {packed_weight.dtype} for "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    del isa
    packed_weight.copy_(weight)


def cpu_fused_moe(
    output: torch.Tensor,
    input: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_id: torch.Tensor,
    skip_weighted: bool,
    act: str,
    isa: str,
) -> None:
    """Each token's routed experts, summed with its routing weights (unweighted with
    ``skip_weighted``, where vLLM applied them to the input), into ``output [tokens,
    hidden]``.

    ``input [tokens, hidden]``; ``w13 [experts, 2 * inter, hidden]`` (gate rows, then up
    rows) and ``w2 [experts, hidden, inter]`` as :func:`prepack_moe_weight` wrote them;
    biases ``[experts, 2 * inter]`` / ``[experts, hidden]``; ``topk_weights`` float32 and
    ``topk_id`` (int) ``[tokens, k]``; ``act``: ``silu``, ``gelu`` or ``gelu_tanh``.
    Accumulates in float32."""
    gate_act = _GATED.get(act)
    if gate_act is None:
        raise ValueError(f"cpu_fused_moe takes act in {sorted(_GATED)}, got {act!r}")
    if skip_weighted and topk_id.shape[-1] != 1:
        raise ValueError(
            "cpu_fused_moe takes skip_weighted (weights applied to the input) with one "
            f"expert per token, got topk_id {tuple(topk_id.shape)}"
        )
    del isa
    x = input.float()
    total = torch.zeros(output.shape, dtype=torch.float32)
    for expert in torch.unique(topk_id).tolist():
        tokens, slots = torch.nonzero(topk_id == expert, as_tuple=True)
        hidden = x[tokens] @ w13[expert].float().T
        if w13_bias is not None:
            hidden = hidden + w13_bias[expert].float()
        gate, up = hidden.chunk(2, dim=-1)
        expert_out = (gate_act(gate) * up) @ w2[expert].float().T
        if w2_bias is not None:
            expert_out = expert_out + w2_bias[expert].float()
        if not skip_weighted:
            expert_out = expert_out * topk_weights[tokens, slots].float().unsqueeze(1)
        total.index_add_(0, tokens, expert_out)
    output.copy_(total.to(output.dtype))
