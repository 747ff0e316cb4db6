"""MLA decode and spec decode as updatable host-graph tasks: capture once, update with
each step's plan (KV lengths, cumulative query lengths, block table; padding requests
of ``q`` tokens over the null block, as the builder plans them), replay. Every replay must match a float64 absorbed-attention oracle over
the raw latents; the control replays without the update and must be caught stale.
"""

from __future__ import annotations

import pytest
import torch

import npu_attention
from npu_attention.mla import MLASpec, allocate_latent_cache
from npu_graphs import GraphWrapper, RuntimeMode, TaskRegistry, graph_dispatch
from npu_vllm_bridge.attention.builder import count_leading_decodes
from npu_vllm_bridge.attention.mla_builder import BridgeMLAMetadata, MLARows, pad_requests
from npu_vllm_bridge.attention.tasks import run_mla_decode, run_mla_write_cache

HEADS, RANK, NOPE, ROPE, V = 4, 32, 16, 16, 16
BLOCK, NUM_BLOCKS, BATCH, WIDTH = 16, 64, 4, 8
SPEC = MLASpec(HEADS, RANK, NOPE, ROPE, V, BLOCK, torch.float32, num_speculative_tokens=1)
ATOL = 2e-5
LAYER = "model.layers.0.self_attn.attn"
# Per step, the context lengths of the 4 decodes; None is a graph-padding request.
STEPS = [(40, 3, 77, 15), (41, 4, 78, 16), (7, 90, 1, None), (12, 5, None, None)]


def _step(contexts, cache, generator, q):
    """Plan a decode step of ``q`` query tokens per request (``q = 2``: a verify step of
    one speculative token) after writing each request's context latents into ``cache``;
    the new tokens are written by the graphed write task."""
    real = [c for c in contexts if c is not None]
    blocks = torch.randperm(NUM_BLOCKS - 1, generator=generator)[: len(real) * WIDTH] + 1
    tables = torch.zeros(BATCH, WIDTH, dtype=torch.int32)
    tables[: len(real)] = blocks.view(len(real), WIDTH).to(torch.int32)
    query_lens = [q] * len(real) + [0] * (BATCH - len(real))
    seq_lens = [c + q for c in real] + [0] * (BATCH - len(real))
    num_real = pad_requests(query_lens, seq_lens, BATCH * q, q)
    assert num_real == len(real)
    assert query_lens[num_real:] == seq_lens[num_real:] == [q] * (BATCH - num_real)
    slots = torch.full((BATCH * q,), -1, dtype=torch.int64)
    latents = torch.randn(NUM_BLOCKS * BLOCK, RANK + ROPE, generator=generator)
    for i, context in enumerate(real):
        positions = torch.arange(context + q)
        flat = tables[i, positions // BLOCK].long() * BLOCK + positions % BLOCK
        cache.kv_c.view(-1, RANK)[flat[:context]] = latents[flat[:context], :RANK]
        cache.k_pe.view(-1, ROPE)[flat[:context]] = latents[flat[:context], RANK:]
        slots[i * q : (i + 1) * q] = flat[context:]
    plan = npu_attention.plan(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()],
        seq_lens,
        tables,
        slots,
        BATCH,  # padding requests join a decode-only step
        SPEC,
        provider="reference",
    )
    metadata = BridgeMLAMetadata(
        plan=plan,
        num_actual_tokens=BATCH * q,
        num_reqs=BATCH,
        num_decodes=BATCH,
        num_decode_tokens=BATCH * q,
        num_prefills=0,
        decode=MLARows(BATCH, BATCH * q),
        prefill=None,
    )
    return metadata, latents, tables, seq_lens[:num_real]


class _Inputs:
    """Static inputs of the captured step (the caller owns their addresses)."""

    def __init__(self, rows):
        self.rows = rows
        self.q_latent = torch.zeros(rows, HEADS, RANK)
        self.q_rope = torch.zeros(rows, HEADS, ROPE)
        self.kv_c = torch.zeros(rows, RANK)
        self.k_pe = torch.zeros(rows, ROPE)

    def load(self, generator, latents, slots):
        self.q_latent.copy_(torch.randn(self.rows, HEADS, RANK, generator=generator))
        self.q_rope.copy_(torch.randn(self.rows, HEADS, ROPE, generator=generator))
        real = slots >= 0
        self.kv_c.zero_()
        self.k_pe.zero_()
        self.kv_c[real] = latents[slots[real], :RANK]
        self.k_pe[real] = latents[slots[real], RANK:]


def _decode_step(inputs, cache, current):
    """The graphed callable: one MLA layer's latent write and absorbed decode."""

    def step(_):
        metadata = current["metadata"]
        run_mla_write_cache(inputs.kv_c * 1.0, inputs.k_pe * 1.0, cache, metadata, layer_name=LAYER)
        out = inputs.q_latent.new_zeros(inputs.rows, HEADS, RANK)
        run_mla_decode(
            inputs.q_latent * 1.0, inputs.q_rope * 1.0, cache, out, None, metadata,
            layer_name=LAYER,
        )  # fmt: skip
        return out * 1.0

    return step


def _oracle(inputs, latents, tables, seq_lens, q) -> torch.Tensor:
    """float64 absorbed attention over the raw latents, query token ``t`` of a request
    seeing its first ``seq_len - q + t + 1`` positions: the rows of the real requests
    (those of ``seq_lens``; padding rows attend the null block and are discarded)."""
    out = torch.zeros(len(seq_lens) * q, HEADS, RANK, dtype=torch.float64)
    for i, seq_len in enumerate(seq_lens):
        for t in range(q):
            positions = torch.arange(seq_len - q + t + 1)
            flat = tables[i, positions // BLOCK].long() * BLOCK + positions % BLOCK
            rows = latents[flat].double()
            row = i * q + t
            scores = inputs.q_latent[row].double() @ rows[:, :RANK].T
            scores += inputs.q_rope[row].double() @ rows[:, RANK:].T
            out[row] = torch.softmax(scores * SPEC.softmax_scale, dim=-1) @ rows[:, :RANK]
    return out


def _run_steps(update: bool, seed: int, q: int = 1) -> list[float]:
    """Errors of each step's graph output against the oracle."""
    generator = torch.Generator().manual_seed(seed)
    cache = allocate_latent_cache(NUM_BLOCKS, SPEC)
    inputs, current = _Inputs(BATCH * q), {}
    registry = TaskRegistry("attention", expected_tasks=2)
    graph = GraphWrapper(_decode_step(inputs, cache, current), backend="host", tasks=registry)
    errors = []
    for index, contexts in enumerate(STEPS):
        metadata, latents, tables, seq_lens = _step(contexts, cache, generator, q)
        inputs.load(generator, latents, metadata.plan.slot_mapping)
        current["metadata"] = metadata
        if index and update:
            registry.update("decode-4", {LAYER: metadata})
        with graph_dispatch(RuntimeMode.FULL, "decode-4"):
            out = graph(None)
        expected = _oracle(inputs, latents, tables, seq_lens, q)
        errors.append(float((out[: expected.shape[0]].double() - expected).abs().max()))
    assert graph.entry("decode-4").replays == len(STEPS) - 1
    return errors


@pytest.mark.parametrize("q", [1, 2], ids=["decode", "spec-decode"])
def test_mla_task_update_makes_each_replay_match_the_oracle(q):
    errors = _run_steps(update=True, seed=3, q=q)
    assert max(errors) < ATOL, errors


@pytest.mark.parametrize("q", [1, 2], ids=["decode", "spec-decode"])
def test_mla_replay_without_update_is_stale(q):
    """The control: a skipped update replays the captured step's KV lengths, block
    table and slots, and the outputs are wrong by far more than the tolerance."""
    errors = _run_steps(update=False, seed=3, q=q)
    assert errors[0] < ATOL
    assert min(errors[1:]) > 1e-2, errors


def test_padding_requests_bring_the_spare_tokens_and_join_the_decodes():
    """A verify step of 3 requests of 2 tokens padded to 10 tokens (5 requests): the
    padding requests take 2 tokens and 2 keys each (cumulative query ends in multiples
    of 2, every request of the fused op with 1 to 16 query tokens)."""
    query_lens, seq_lens = [2, 2, 2, 0, 0], [9, 4, 12, 0, 0]
    assert pad_requests(query_lens, seq_lens, 10, 2) == 3
    assert query_lens == [2, 2, 2, 2, 2] and seq_lens == [9, 4, 12, 2, 2]
    assert count_leading_decodes(query_lens, 2) == 5
    assert count_leading_decodes([1, 5, 1], 2) == 1


def test_padding_requests_without_spare_tokens_get_kv_length_zero():
    query_lens, seq_lens = [1, 1, 2, 0, 0], [9, 4, 12, 1, 1]
    assert pad_requests(query_lens, seq_lens, 4, 2) == 3  # no spare token
    assert query_lens == [1, 1, 2, 0, 0] and seq_lens == [9, 4, 12, 0, 0]
