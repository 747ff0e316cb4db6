"""The MLA impl's latent write as vLLM's layer calls it: vLLM 0.32 passes six arguments,
0.33 a seventh, ``skip_scale``. Either way the step's latents must land at the plan's
slots, byte for byte (a scatter, no arithmetic), and nothing else in the cache changes.
"""

from __future__ import annotations

import pytest
import torch
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl

import npu_attention
from npu_attention.mla import MLASpec
from npu_vllm_bridge.attention.mla_builder import BridgeMLAMetadata, MLARows
from npu_vllm_bridge.attention.mla_impl import BridgeMLAImpl

HEADS, RANK, NOPE, ROPE, V = 2, 32, 16, 16, 16
BLOCK, NUM_BLOCKS = 16, 8
SPEC = MLASpec(HEADS, RANK, NOPE, ROPE, V, BLOCK, torch.float32)
LAYER = "model.layers.0.self_attn.attn"


def _impl() -> BridgeMLAImpl:
    """The impl's write path only (its projections are vLLM's and unused here)."""
    impl = object.__new__(BridgeMLAImpl)
    impl.kv_cache_split = "packed"
    impl.kv_cache_dtype = "auto"  # set by vLLM's MLACommonImpl.__init__, bypassed here
    impl._layer_name = LAYER
    return impl


def _prefill_metadata(slots: torch.Tensor) -> BridgeMLAMetadata:
    rows = slots.numel()
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32)[None, :]
    plan = npu_attention.plan([0, rows], [rows], table, slots, 0, SPEC, provider="reference")
    return BridgeMLAMetadata(
        plan=plan, num_actual_tokens=rows, num_reqs=1, num_decodes=0, num_decode_tokens=0,
        num_prefills=1, decode=None, prefill=MLARows(1, rows),
    )  # fmt: skip


@pytest.mark.parametrize("skip_scale", [None, False, True], ids=["0.32", "0.33", "0.33-fp8"])
def test_latents_land_at_the_plans_slots(skip_scale) -> None:
    generator = torch.Generator().manual_seed(3)
    rows = 20
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=generator)[:rows]
    kv_c = torch.randn(rows, RANK, generator=generator)
    k_pe = torch.randn(rows, 1, ROPE, generator=generator)  # vLLM's [rows, 1, rope]
    kv_cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=generator)
    expected = kv_cache.clone().view(-1, RANK + ROPE)
    expected[slots] = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1)
    args = [kv_c, k_pe, kv_cache, slots, "auto", torch.ones(())]
    if skip_scale is not None:
        args.append(skip_scale)  # positional, as vLLM 0.33's MLAAttention passes it
    with set_forward_context({LAYER: _prefill_metadata(slots)}, VllmConfig()):
        _impl().do_kv_cache_update(*args)
    assert torch.equal(kv_cache.view(-1, RANK + ROPE), expected)


def test_takes_every_argument_vllms_impl_takes() -> None:
    """This vLLM's own ``do_kv_cache_update`` parameters, in order, are the impl's."""
    import inspect

    theirs = list(inspect.signature(MLACommonImpl.do_kv_cache_update).parameters)
    ours = list(inspect.signature(BridgeMLAImpl.do_kv_cache_update).parameters)
    assert ours[: len(theirs)] == theirs
