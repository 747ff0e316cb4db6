"""Decode context parallelism in the bridge: two DCP ranks against unsharded attention.

Each rank keeps its share of every request's KV (vLLM 0.32's interleaving, through
npu-attention's ``dcp_slot_mapping``) and its own query heads; ``dcp_attention`` runs
on both ranks at once (threads exchanging through in-process collectives, or two
processes over gloo) and the ranks' outputs, side by side, must equal float64 causal
attention of all heads over the whole context. Also: the builder's per-rank lengths
(padded requests 0, the capture's longest context), vLLM's DCP flags, and the refusals.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from dcp_steps import (
    ATOL,
    BLOCK_SIZE,
    DCP,
    HEAD_SIZE,
    HEADS,
    LOCAL_HEADS,
    REQUESTS,
    Step,
    gloo_rank,
)
from vllm_builds import needs_vllm_cpu_platform

from npu_attention import dcp_local_seq_lens
from npu_attention.context_parallel import dcp_slot_mapping
from npu_vllm_bridge.attention import context_parallel as cp
from npu_vllm_bridge.attention.context_parallel import dcp_attention
from npu_vllm_bridge.settings import BridgeSettings


class ThreadGroup:
    """In-process stand-in for vLLM's DCP group: ranks are threads that meet at a barrier."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier, self.slots = size, threading.Barrier(size), [None] * size

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts

    def all_gather_(self, out, input, group):
        out.copy_(torch.cat(self.exchange(group, input)))

    def all_to_all_(self, out, input, group):
        parts = self.exchange(group, input)
        out.copy_(torch.stack([p[group] for p in parts]))


def _run_ranks(step: Step, monkeypatch) -> list[torch.Tensor]:
    fake = ThreadGroup(DCP)
    monkeypatch.setattr(cp, "all_gather_", fake.all_gather_)
    monkeypatch.setattr(cp, "all_to_all_", fake.all_to_all_)
    outs, errors = [None] * DCP, []

    def rank_main(rank: int) -> None:
        try:
            plans = step.plans(rank)
            metadata = {"layer": SimpleNamespace(plan=plans.new_plan, dcp=plans)}
            out = torch.full((step.num_tokens, LOCAL_HEADS, HEAD_SIZE), float("nan"))
            group = SimpleNamespace(world_size=DCP, device_group=rank)
            dcp_attention(
                *step.rank_inputs(rank), out, group, metadata["layer"], layer_name="layer"
            )
            outs[rank] = out
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)
            fake.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(DCP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outs


@pytest.mark.parametrize("interleave", [1, 4, 16])
def test_dcp_ranks_together_equal_unsharded_attention(interleave, monkeypatch):
    step = Step(REQUESTS, interleave, seed=interleave)
    outs = _run_ranks(step, monkeypatch)
    real = step.cu[-1]
    merged = torch.cat(outs, dim=1)
    torch.testing.assert_close(merged[:real].double(), step.expected()[:real], atol=ATOL, rtol=0)
    assert (merged[real:] == 0).all()  # graph padding rows: zeros, not NaN


def test_dcp_step_writes_each_rank_share_of_the_new_tokens(monkeypatch):
    step = Step(REQUESTS, 1, seed=3)
    before = [tuple(c.clone() for c in caches) for caches in step.caches]
    _run_ranks(step, monkeypatch)
    for rank in range(DCP):
        slots = step.slots[rank]
        mine = torch.nonzero(slots >= 0).flatten()
        kept = slots[mine]
        k_cache, v_cache = step.caches[rank]
        blocks, offsets = kept // BLOCK_SIZE, kept % BLOCK_SIZE
        torch.testing.assert_close(k_cache[blocks, offsets], step.key[mine])
        torch.testing.assert_close(v_cache[blocks, offsets], step.value[mine])
        k_cache[blocks, offsets] = before[rank][0][blocks, offsets]
        torch.testing.assert_close(k_cache, before[rank][0], equal_nan=True)  # nothing else
    # The two ranks wrote disjoint halves of the step's tokens.
    owned = [set(torch.nonzero(s >= 0).flatten().tolist()) for s in step.slots]
    assert owned[0].isdisjoint(owned[1]) and len(owned[0] | owned[1]) == step.cu[-1]


def test_dcp_attention_over_gloo_equals_unsharded_attention():
    """The real collectives (the bridge's custom ops over torch.distributed/gloo)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=gloo_rank, args=(r, port, queue)) for r in range(DCP)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    step = Step(REQUESTS, 1, seed=11)
    real = step.cu[-1]
    merged = torch.cat([torch.from_numpy(results[r]) for r in range(DCP)], dim=1)
    torch.testing.assert_close(merged[:real].double(), step.expected()[:real], atol=ATOL, rtol=0)


def test_local_context_lengths_follow_the_interleaving():
    step = Step(REQUESTS, 4)
    context = [c for c, _ in REQUESTS]
    for rank in range(DCP):
        plans = step.plans(rank)
        expected = dcp_local_seq_lens(context, DCP, 4, rank).tolist()
        assert plans.local_context_lens == expected
        assert plans.context_plan.seq_lens_host == expected
        assert plans.context_plan.spec.num_heads == HEADS and not plans.context_plan.spec.causal
        assert plans.new_plan.seq_lens_host == step.query_lens and not plans.new_plan.has_cache


# ---------------------------------------------------------------- builder, flags, refusals


def _mqa_layers():
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from npu_vllm_bridge.attention.backend import NPUBridgeAttentionBackend

    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK_SIZE))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    with set_current_vllm_config(config):
        for name in names:
            Attention(
                num_heads=LOCAL_HEADS,
                head_size=HEAD_SIZE,
                scale=HEAD_SIZE**-0.5,
                num_kv_heads=1,
                prefix=name,
                attn_backend=NPUBridgeAttentionBackend,
            )
    return config, names


def _common(query_lens, seq_lens, width, pad_tokens=0):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    tokens = int(cu[-1]) + pad_tokens
    return CommonAttentionMetadata(
        query_start_loc=cu.clone(),
        query_start_loc_cpu=cu,
        seq_lens=seq.clone(),
        seq_lens_cpu_upper_bound=seq,
        num_reqs=len(query_lens),
        num_actual_tokens=tokens,
        max_query_len=max(query_lens),
        max_seq_len=int(seq.max()),
        block_table_tensor=torch.arange(1, 1 + len(query_lens) * width, dtype=torch.int32).view(
            len(query_lens), width
        ),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64),
    )


@needs_vllm_cpu_platform
@pytest.mark.parametrize("rank", range(DCP))
def test_builder_plans_the_rank_share_padded_requests_get_zero(rank, monkeypatch):
    """A FULL-graph padded decode batch (two requests of length 0 at the end): the
    context plan's lengths are the rank's local context lengths, 0 for the padding; the
    capture build plans the longest context a block table can address on every rank."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from npu_vllm_bridge.attention import builder as builder_module
    from npu_vllm_bridge.attention.builder import BridgeMetadataBuilder

    config, names = _mqa_layers()
    layout = cp.DCPLayout(DCP, rank, 1)
    monkeypatch.setattr(builder_module, "dcp_layout_of", lambda *args, **kwargs: layout)
    kv_spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float32
    )
    builder = BridgeMetadataBuilder(kv_spec, names, config, torch.device("cpu"))
    assert builder.reorder_batch_threshold == 1
    common = _common([1, 1, 0, 0], [41, 4, 0, 0], width=2, pad_tokens=2)
    metadata = builder.build(0, common)
    expected = [*dcp_local_seq_lens([40, 3], DCP, 1, rank).tolist(), 0, 0]
    assert metadata.dcp.local_context_lens == expected
    assert metadata.dcp.context_plan.seq_lens_host == expected
    assert metadata.dcp.context_plan.num_decodes == 4
    assert metadata.plan is metadata.dcp.new_plan
    assert metadata.dcp.new_plan.seq_lens_host == [1, 1, 1, 1]
    capture = builder.build_for_cudagraph_capture(_common([1, 1, 1], [1, 1, 1], width=3))
    longest = 3 * BLOCK_SIZE * DCP  # a block-table entry covers BLOCK_SIZE tokens per rank
    assert (
        capture.dcp.local_context_lens
        == [int(dcp_local_seq_lens([longest - 1], DCP, 1, rank)[0])] * 3
    )


def test_impl_declares_dcp_and_natural_log_lse(monkeypatch):
    import vllm.distributed.parallel_state as parallel_state

    from npu_vllm_bridge.attention.backend import NPUBridgeAttentionBackend, NPUBridgeMLABackend
    from npu_vllm_bridge.attention.impl import BridgeAttentionImpl

    assert NPUBridgeAttentionBackend.supports_dcp()
    assert not NPUBridgeAttentionBackend.supports_pcp()  # vLLM 0.32 runs PCP for MLA only
    assert NPUBridgeMLABackend.supports_pcp()
    assert BridgeAttentionImpl.can_return_lse_for_decode and BridgeAttentionImpl.lse_base_on_e
    args = dict(num_heads=LOCAL_HEADS, head_size=HEAD_SIZE, scale=0.125, num_kv_heads=1)
    assert not BridgeAttentionImpl(**args).need_to_return_lse_for_decode  # no DCP group
    monkeypatch.setattr(parallel_state, "get_dcp_world_size_and_rank", lambda enabled=True: (2, 1))
    impl = BridgeAttentionImpl(**args)
    # What vLLM's check_attention_cp_compatibility asserts for DCP.
    assert impl.need_to_return_lse_for_decode and (impl.dcp_world_size, impl.dcp_rank) == (2, 1)
    with pytest.raises(
        ValueError,
        match=r"decode_context_parallel_size=2\) for full attention only, got a layer with sliding_window=8",
    ):
        BridgeAttentionImpl(**args, sliding_window=8)
    with pytest.raises(ValueError, match=r"kv_sharing_target_layer_name='model.layers.0"):
        BridgeAttentionImpl(**args, kv_sharing_target_layer_name="model.layers.0.self_attn.attn")


def _config(dcp=1, pcp=1, use_mla=False, speculative=None, sliding_window=None):
    model = SimpleNamespace(model="m", use_mla=use_mla, get_sliding_window=lambda: sliding_window)
    parallel = SimpleNamespace(decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp)
    return SimpleNamespace(
        parallel_config=parallel, model_config=model, speculative_config=speculative
    )


def test_context_parallel_checks_accept_dcp_for_gqa_full_attention():
    from npu_vllm_bridge.platforms.context_parallel_checks import check_context_parallel

    check_context_parallel(_config())
    check_context_parallel(_config(dcp=2))
    check_context_parallel(_config(dcp=2, use_mla=True))  # reference MLA returns the LSE
    check_context_parallel(_config(pcp=2, use_mla=True))


def test_context_parallel_checks_refuse_mla_dcp_on_a_provider_without_lse(monkeypatch):
    from vllm.platforms import current_platform

    from npu_attention.providers.ascend_mla import AscendMLAProvider
    from npu_vllm_bridge.platforms.context_parallel_checks import check_context_parallel

    monkeypatch.setattr(
        type(current_platform), "bridge_settings", BridgeSettings("ascend"), raising=False
    )
    check_context_parallel(_config(dcp=2, use_mla=True))  # ascend's MLA returns the LSE
    monkeypatch.setattr(AscendMLAProvider, "returns_lse", False)
    with pytest.raises(ValueError, match=r"MLA models \(m\) only with an MLA provider that"):
        check_context_parallel(_config(dcp=2, use_mla=True))
    check_context_parallel(_config(dcp=2))  # GQA on ascend returns the LSE


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            dict(pcp=2, use_mla=True, speculative=SimpleNamespace(method="mtp")),
            r"prefill context parallelism \(prefill_context_parallel_size=2\) with "
            r"speculative decoding \(method='mtp'\)",
        ),
        (
            dict(pcp=2, dcp=2, use_mla=True),
            r"together with decode context parallelism \(decode_context_parallel_size=2\)",
        ),
        (
            dict(dcp=2, speculative=SimpleNamespace(method="ngram")),
            r"with speculative decoding \(method='ngram'\)",
        ),
        (dict(dcp=2, sliding_window=4096), "full attention only, got sliding_window=4096"),
    ],
)
def test_context_parallel_checks_refuse_what_does_not_run(config, message):
    from npu_vllm_bridge.platforms.context_parallel_checks import check_context_parallel

    with pytest.raises(ValueError, match=message):
        check_context_parallel(_config(**config))


@pytest.mark.parametrize(
    ("cp_size", "rank", "interleave"), [(2, 0, 1), (2, 1, 1), (2, 1, 16), (4, 3, 8)]
)
def test_host_slot_mapping_follows_vllm_dcp_rule(cp_size, rank, interleave):
    """The host platform's slot-mapping kernel (vLLM's CPU one refuses CP) against
    npu-attention's DCP slot mapping; padding rows of the buffer get -1."""
    from npu_vllm_bridge.host.slot_mapping import compute_slot_mapping

    query_lens, context = [1, 3, 20], [70, 0, 33]
    qsl = torch.tensor([0, 1, 4, 24], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context, query_lens)])
    table = torch.randperm(40)[:24].view(3, 8).to(torch.int32)
    slots = torch.full((32,), 7, dtype=torch.int64)
    compute_slot_mapping(
        24, 32, qsl, positions, table, 8, slots, BLOCK_SIZE, cp_size, rank, interleave, -1, 1024
    )
    request = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens))
    expected = dcp_slot_mapping(
        positions.numpy(), request.numpy(), table.numpy(), BLOCK_SIZE, cp_size, rank, interleave
    )
    assert slots[:24].tolist() == expected.tolist()
    assert (slots[24:] == -1).all()
