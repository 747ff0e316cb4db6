"""vLLM's CPU linear dispatch at bfloat16 in host mode (``compiled_ops.avoid_missing_packed_gemm``).

vLLM's ``dispatch_cpu_unquantized_gemm`` packs small bf16/fp16 weights on AMX CPUs for
its compiled SGL GEMM (``convert_weight_packed``, ``weight_packed_linear``), which a
vLLM built empty lacks. Each case runs vLLM's own dispatch on a layer and its
``cpu_linear`` on activations, against ``torch.nn.functional.linear`` in float32 at a
bfloat16 tolerance. On the empty build the routed layers must equal torch's bfloat16
linear exactly, and vLLM's own check must send the same layers to the missing op (the
fault the route removes). With ``vllm._C`` the route stays off, and the compiled
packed-weight GEMM and the routed (oneDNN) one are compared with each other too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from vllm_builds import COMPILED_OPS

from npu_vllm_bridge import vllm_seam
from npu_vllm_bridge.host import compiled_ops as ops

# Two bfloat16 ulps of the output (8 significand bits), and an absolute floor for outputs
# near zero (fp32 accumulation over K <= 576 of terms ~1/sqrt(K)).
RTOL = 2.0**-7
ATOL = 2.0**-10

# (N, K, bias, input shape without K): SmolLM2-135M's o_proj (the layer that failed at
# vLLM's defaults), a router-sized N < 16 (vLLM's kernel keeps it in float32), a bias.
CASES = [
    (576, 576, False, (5,)),
    (576, 576, True, (2, 3)),
    (8, 40, False, (1,)),
    (48, 64, True, (7,)),
]


def _layer(n: int, k: int, bias: bool, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    weight = torch.randn(n, k, generator=generator) / k**0.5
    layer.weight = torch.nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
    layer.bias = None
    if bias:
        layer.bias = torch.nn.Parameter(
            torch.randn(n, generator=generator).to(torch.bfloat16), requires_grad=False
        )
    return layer


def _inputs(k: int, rows: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 100)
    return torch.randn(*rows, k, generator=generator).to(torch.bfloat16)


def _dispatched(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """vLLM's dispatch on ``layer`` as its linear layers make it, then one call."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    weight = layer.weight.detach().clone()
    bias = None if layer.bias is None else layer.bias.detach().clone()
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    out = layer.cpu_linear(x, layer.weight, layer.bias)
    assert out.dtype == torch.bfloat16 and out.shape == (*x.shape[:-1], weight.shape[0])
    layer.reference = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    layer.bf16_linear = F.linear(x, weight, bias)
    return out


def _close(out: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(out.float(), reference, rtol=RTOL, atol=ATOL)


@pytest.mark.skipif(COMPILED_OPS, reason="this vLLM build has vllm._C (its own packed GEMM)")
@pytest.mark.parametrize(("n", "k", "bias", "rows"), CASES)
def test_empty_build_routes_packed_layers_to_torch_linear(monkeypatch, n, k, bias, rows) -> None:
    # What vLLM sees on an AMX CPU, whatever this machine has: no AMX kernel runs here.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert ops.avoid_missing_packed_gemm()
    assert vllm_seam.cpu_sgl_gemm_check() is ops.never_packed
    vllm_check = ops.vllm_packed_gemm_check()
    assert vllm_check(n, k, torch.bfloat16), "vLLM would not pack this weight"
    with (
        vllm_seam.swap_module_attribute(vllm_seam.CPU_SGL_GEMM_CHECK, vllm_check),
        pytest.raises(AttributeError, match="convert_weight_packed"),
    ):
        _dispatched(_layer(n, k, bias, 0), _inputs(k, rows, 0))
    layer = _layer(n, k, bias, 0)
    out = _dispatched(layer, _inputs(k, rows, 0))
    assert torch.equal(out, layer.bf16_linear)
    _close(out, layer.reference)


@pytest.mark.skipif(not COMPILED_OPS, reason="this vLLM build has no vllm._C")
@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM packs only on AMX")
@pytest.mark.parametrize(("n", "k", "bias", "rows"), CASES)
def test_routed_layers_match_the_compiled_packed_gemm(n, k, bias, rows) -> None:
    assert not ops.avoid_missing_packed_gemm()
    assert vllm_seam.cpu_sgl_gemm_check() is ops.vllm_packed_gemm_check()
    assert ops.vllm_packed_gemm_check()(n, k, torch.bfloat16), "vLLM would not pack this weight"
    packed = _layer(n, k, bias, 1)
    theirs = _dispatched(packed, _inputs(k, rows, 1))
    _close(theirs, packed.reference)
    with vllm_seam.swap_module_attribute(vllm_seam.CPU_SGL_GEMM_CHECK, ops.never_packed):
        routed = _layer(n, k, bias, 1)
        ours = _dispatched(routed, _inputs(k, rows, 1))
    _close(ours, routed.reference)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
