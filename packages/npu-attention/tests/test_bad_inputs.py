"""Every rejected input raises ValueError/TypeError naming what was expected and what came."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from npu_attention import (
    AttentionSpec,
    PlanBuffers,
    get_provider,
    plan,
    registry,
    run,
    supported_head_sizes,
)
from npu_attention.providers.base import AttentionProvider
from npu_attention.providers.reference import ReferenceProvider
from npu_attention.registry import register_provider

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)
CU, SEQ, SLOTS, DECODES = [0, 1, 4], [10, 3], [25, 33, 34, 35], 1
TABLES = [[1, 2], [2, 0]]


def _plan(**overrides):
    args = dict(
        cu_seqlens_q=CU, seq_lens=SEQ, block_tables=TABLES, slot_mapping=SLOTS,
        num_decodes=DECODES, spec=SPEC,
    )  # fmt: skip
    args.update(overrides)
    return plan(**args)


# --- spec ---------------------------------------------------------------------------


@pytest.mark.parametrize("head_size", [0, -64, 2048, 64.0, True])
def test_head_size_outside_sanity_range(head_size: object) -> None:
    with pytest.raises(ValueError, match=r"head_size must be an int in \[1, 1024\], got"):
        AttentionSpec(4, 2, head_size, 16)


def test_head_size_any_provider_lacks_is_a_valid_spec() -> None:
    assert AttentionSpec(4, 2, 48, 16).head_size == 48


@pytest.mark.parametrize("provider", ["reference", "triton", "ascend"])
def test_supported_head_sizes_are_declared_per_provider(provider: str) -> None:
    sizes = supported_head_sizes(provider)
    assert sizes == registry._provider_class(provider).head_sizes
    assert 64 in sizes and 48 not in sizes


def test_supported_head_sizes_by_device_and_refusals() -> None:
    assert supported_head_sizes(device="cpu") == supported_head_sizes("reference")
    with pytest.raises(ValueError, match="unknown attention provider 'nope'"):
        supported_head_sizes("nope")
    with pytest.raises(ValueError, match="needs a provider name or a device"):
        supported_head_sizes()


def test_plan_refuses_a_head_size_its_provider_does_not_take() -> None:
    spec = AttentionSpec(4, 2, 48, 16, dtype=torch.float32)
    message = (
        r"attention provider 'reference' does not support head_size=48; its head sizes "
        r"are \[32, 64, 80, 96, 112, 128, 160, 192, 224, 256\]"
    )
    with pytest.raises(ValueError, match=message):
        _plan(spec=spec, provider="reference")
    with pytest.raises(ValueError, match=message):
        _plan(spec=spec, device="cpu")


class _Head48Provider(ReferenceProvider):
    name = "head_48"
    head_sizes = (48,)


def test_plan_asks_the_chosen_provider_for_its_head_sizes(monkeypatch) -> None:
    monkeypatch.setattr(registry, "_LAZY_PROVIDERS", dict(registry._LAZY_PROVIDERS))
    monkeypatch.setattr(registry, "_INSTANCES", dict(registry._INSTANCES))
    register_provider("head_48", f"{__name__}:_Head48Provider")
    spec = AttentionSpec(4, 2, 48, 16, dtype=torch.float32)
    assert _plan(spec=spec, provider="head_48").spec.head_size == 48
    with pytest.raises(ValueError, match=r"'head_48' does not support head_size=64; .*\[48\]"):
        _plan(provider="head_48")


def test_unsupported_dtype() -> None:
    with pytest.raises(TypeError, match=r"dtype must be one of .*got torch.float64"):
        AttentionSpec(4, 2, 64, 16, dtype=torch.float64)


def test_heads_not_a_multiple() -> None:
    with pytest.raises(ValueError, match="num_heads=6, num_kv_heads=4"):
        AttentionSpec(6, 4, 64, 16)


@pytest.mark.parametrize("block_size", [8, 24, 256])
def test_unsupported_block_size(block_size: int) -> None:
    with pytest.raises(ValueError, match=f"got {block_size}"):
        AttentionSpec(4, 2, 64, block_size)


# --- plan ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(cu_seqlens_q=[1, 2, 4]), r"must start at 0, got 1"),
        (dict(cu_seqlens_q=[0, 3, 2]), r"non-decreasing, got cu_seqlens_q\[1\]=3 > cu_seqlens_q\[2\]=2"),
        (dict(cu_seqlens_q=[0, 1, 4, 5]), r"len\(seq_lens\) \+ 1 = 3 entries, got 4"),
        (dict(seq_lens=[10, 2]), r"seq_lens\[1\] must be at least the request's query length 3, got 2"),
        (dict(block_tables=[[1, 2]]), r"one row per request \(2\), got shape \(1, 2\)"),
        (dict(slot_mapping=[1, 2, 3]), r"cover the 4 query tokens .* got 3 slots"),
        (dict(seq_lens=[33, 3]), r"seq_lens\[0\]=33 exceeds its block table: 2 blocks x block_size 16 = 32"),
        (dict(seq_lens=[2**31, 3]), r"seq_lens must fit in int32, got 2147483648"),
        (dict(num_blocks=2), r"block id must be in \[0, num_blocks=2\), got block_tables\[1, 0\]=2"),
        (dict(block_tables=[[-4, 2], [2, 0]]), r"got block_tables\[0, 0\]=-4"),
        (dict(slot_mapping=[25, 33, 34, 48]), r"slot must be < num_blocks \* block_size = 48, got 48"),
        (dict(num_decodes=3), r"num_decodes must be in \[0, num_reqs=2\], got 3"),
        (dict(num_decodes=2), r"at most 1 \+ num_speculative_tokens = 1 query tokens, got 3 for request 1"),
        (dict(cu_seqlens_q=[[0, 1, 4]]), r"cu_seqlens_q must be 1-D, got shape \(1, 3\)"),
        (dict(block_tables=[1, 2]), r"block_tables must be 2-D, got shape \(2,\)"),
        (dict(device="npu"), r"device 'npu' is not available on this machine"),
        (dict(provider="flash"), r"unknown attention provider 'flash'; expected one of"),
        (dict(device="meta"), r"device 'meta' is not available on this machine"),
    ],
)  # fmt: skip
def test_plan_rejects(overrides: dict, message: str) -> None:
    if "block_tables" in overrides and "num_blocks" not in overrides:
        overrides["num_blocks"] = 3
    if "slot_mapping" in overrides and "num_blocks" not in overrides:
        overrides["num_blocks"] = 3
    with pytest.raises(ValueError, match=message):
        _plan(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(cu_seqlens_q=[0.0, 1.0, 4.0]), r"cu_seqlens_q must hold integers, got dtype float64"),
        (dict(seq_lens=torch.tensor([10.0, 3.0])), r"seq_lens must hold integers, got dtype torch.float32"),
        (dict(block_tables=torch.ones(2, 2)), r"block_tables must hold integers, got dtype torch.float32"),
        (dict(slot_mapping=np.ones(4, dtype=bool)), r"slot_mapping must hold integers, got dtype bool"),
        (dict(num_decodes=1.0), r"num_decodes must be an int, got float"),
        (dict(spec="spec"), r"spec must be an AttentionSpec or an MLASpec, got str"),
    ],
)  # fmt: skip
def test_plan_rejects_types(overrides: dict, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        _plan(**overrides)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is absent")
def test_plan_on_missing_cuda() -> None:
    with pytest.raises(ValueError, match=r"device 'cuda' is not available on this machine"):
        _plan(device="cuda")


# --- registry -----------------------------------------------------------------------


class _CudaOnlyProvider(AttentionProvider):
    name = "cuda_only_for_tests"
    device_types = ("cuda",)

    def write_kv(self, key, value, key_cache, value_cache, plan) -> None:
        raise NotImplementedError

    def attend(self, query, key_cache, value_cache, plan, out, key=None, value=None) -> None:
        raise NotImplementedError


def test_registry_errors() -> None:
    register_provider(_CudaOnlyProvider.name, f"{__name__}:_CudaOnlyProvider")
    with pytest.raises(ValueError, match=r"runs on \('cuda',\), got tensors on 'cpu'"):
        get_provider(_CudaOnlyProvider.name, "cpu")
    with pytest.raises(ValueError, match=r"unknown attention provider 'nope'"):
        get_provider("nope")
    with pytest.raises(ValueError, match="needs a provider name or a device, got neither"):
        get_provider()
    with pytest.raises(
        ValueError, match=r"provider 'reference' runs on \('cpu', 'cuda'\), got tensors on 'meta'"
    ):
        get_provider("reference", "meta")
    with pytest.raises(ValueError, match=r"no attention provider for device type 'meta'"):
        get_provider(device="meta")
    assert get_provider(device="cpu").name == "reference"


# --- run ----------------------------------------------------------------------------


def _tensors(num_tokens: int = 4):
    q = torch.zeros(num_tokens, 4, 64)
    k = torch.zeros(num_tokens, 2, 64)
    cache = torch.zeros(3, 16, 2, 64)
    return q, k, k.clone(), cache, cache.clone(), torch.zeros_like(q)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update(q=torch.zeros(4, 8, 64)), r"query must have shape \[\*, 4, 64\], got \(4, 8, 64\)"),
        (lambda t: t.update(q=torch.zeros(4, 4, 80)), r"query must have shape \[\*, 4, 64\], got \(4, 4, 80\)"),
        (lambda t: t.update(k=torch.zeros(4, 4, 64)), r"key must have shape \[\*, 2, 64\], got \(4, 4, 64\)"),
        (lambda t: t.update(kc=torch.zeros(3, 16, 1, 64)), r"key_cache must have shape \[\*, 16, 2, 64\], got \(3, 16, 1, 64\)"),
        (lambda t: t.update(vc=torch.zeros(3, 32, 2, 64)), r"value_cache must have shape \[\*, 16, 2, 64\], got \(3, 32, 2, 64\)"),
        (lambda t: t.update(vc=torch.zeros(4, 16, 2, 64)), r"as many blocks, got 3 and 4"),
        (lambda t: t.update(q=torch.zeros(3, 4, 64)), r"query must have >= num_actual_tokens=4 rows, got 3"),
        (lambda t: t.update(out=torch.zeros(2, 4, 64)), r"out must have >= num_actual_tokens=4 rows, got 2"),
        (lambda t: t.update(v=None), "key and value must both be given or both be None"),
        (lambda t: t.update(vc=None), "key_cache and value_cache must both be given or both be None"),
        (lambda t: t.update(k=None, v=None, kc=None, vc=None), "got neither"),
        (lambda t: t.update(kc=None, vc=None), r"context_lens all 0\), got max context length 9"),
        (lambda t: t.update(q=torch.zeros(4, 4, 64, device="meta")), r"query must be on cpu, got meta"),
    ],
)  # fmt: skip
def test_run_rejects(change, message: str) -> None:
    q, k, v, kc, vc, out = _tensors()
    t = dict(q=q, k=k, v=v, kc=kc, vc=vc, out=out)
    change(t)
    with pytest.raises(ValueError, match=message):
        run(t["q"], t["k"], t["v"], t["kc"], t["vc"], _plan(), t["out"])


@pytest.mark.parametrize("name", ["q", "k", "kc", "out"])
def test_run_rejects_dtype(name: str) -> None:
    q, k, v, kc, vc, out = _tensors()
    t = dict(q=q, k=k, v=v, kc=kc, vc=vc, out=out)
    t[name] = t[name].half()
    with pytest.raises(TypeError, match=r"must have dtype torch.float32, got torch.float16"):
        run(t["q"], t["k"], t["v"], t["kc"], t["vc"], _plan(), t["out"])


def test_run_rejects_caches_for_a_plan_without_cache() -> None:
    q, k, v, kc, vc, out = _tensors()
    step = plan([0, 1, 4], [1, 3], None, None, 1, SPEC)
    with pytest.raises(ValueError, match=r"made without block tables"):
        run(q, k, v, kc, vc, step, out)


def test_run_rejects_a_non_plan() -> None:
    q, k, v, kc, vc, out = _tensors()
    with pytest.raises(TypeError, match="plan must be an AttentionPlan, got dict"):
        run(q, k, v, kc, vc, {}, out)


# --- fixed buffers --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        ((1, 8, 4), r"PlanBuffers hold 1 requests, the step has 2"),
        ((4, 3, 4), r"PlanBuffers hold 3 slots, the step has 4"),
        ((4, 8, 1), r"PlanBuffers hold 1 blocks per request, the step needs 2"),
    ],
)
def test_buffer_overflow(capacity: tuple[int, int, int], message: str) -> None:
    buffers = PlanBuffers.allocate(*capacity, device="cpu")
    before = [t.clone() for t in (buffers.meta, buffers.block_tables, buffers.slot_mapping)]
    with pytest.raises(ValueError, match=message):
        _plan(buffers=buffers, seq_lens=[20, 3], block_tables=[[1, 2, 0], [2, 0, 0]])
    after = (buffers.meta, buffers.block_tables, buffers.slot_mapping)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "buffers half-written"


def test_buffers_on_another_device() -> None:
    buffers = PlanBuffers.allocate(4, 8, 4, device="meta")
    with pytest.raises(ValueError, match="PlanBuffers live on meta, the plan is for cpu"):
        _plan(buffers=buffers)


def _lengths(cu=CU, seq=SEQ, dtype=torch.int32):
    return torch.tensor(cu, dtype=dtype), torch.tensor(seq, dtype=dtype)


@pytest.mark.parametrize(
    ("lengths", "error", "message"),
    [
        (_lengths()[0], TypeError, r"device_lengths must be a pair \(cu_seqlens_q, seq_lens\) of tensors"),
        ((CU, _lengths()[1]), TypeError, r"device_lengths' cu_seqlens_q must be a tensor, got list"),
        (_lengths(dtype=torch.int64), ValueError, r"cu_seqlens_q must be a 1-D int32 tensor on cpu, got torch.int64 \(3,\) on cpu"),
        ((_lengths()[0], torch.zeros(2, dtype=torch.int32, device="meta")), ValueError, r"seq_lens must be a 1-D int32 tensor on cpu, got torch.int32 \(2,\) on meta"),
        (_lengths(seq=SEQ[:1]), ValueError, r"seq_lens must hold at least 2 contiguous entries, got shape \(1,\)"),
        ((_lengths()[0], torch.tensor([10, 0, 3, 0], dtype=torch.int32)[::2]), ValueError, r"seq_lens must hold at least 2 contiguous entries, got shape \(2,\) with stride \(2,\)"),
    ],
)  # fmt: skip
def test_plan_rejects_device_lengths(lengths, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _plan(device_lengths=lengths)


def test_device_lengths_and_buffers_are_exclusive() -> None:
    buffers = PlanBuffers.allocate(4, 8, 4, device="cpu")
    before = buffers.meta.clone()
    with pytest.raises(ValueError, match="device_lengths and buffers are exclusive"):
        _plan(device_lengths=_lengths(), buffers=buffers)
    assert torch.equal(buffers.meta, before), "buffers half-written"


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_buffer_capacity_must_be_positive_int(bad) -> None:
    with pytest.raises(ValueError, match=r"max_num_tokens must be a positive int, got"):
        PlanBuffers.allocate(4, bad, 4)
