"""MLA decode context parallelism in the bridge: ``plan_mla_dcp`` against the batch
layout vLLM builds, and each rank's absorbed decode as an updatable host-graph task.

Two DCP ranks are simulated in one process: each has its own latent cache (its share of
every request, as vLLM's DCP slot mapping places it), its own graph and task registry,
and plans its own per-row KV lengths. Each step, the ranks' replays (with their LSEs)
are merged with ``merge_attention_states`` and compared with a float64 oracle of
unsharded attention; the control skips the task update and must be caught stale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from npu_attention import merge_attention_states
from npu_attention.context_parallel import dcp_owner, dcp_slot_mapping
from npu_attention.mla import MLASpec, allocate_latent_cache
from npu_graphs import GraphWrapper, RuntimeMode, TaskRegistry, graph_dispatch
from npu_vllm_bridge.attention.context_parallel import DCPLayout
from npu_vllm_bridge.attention.mla_builder import BridgeMLAMetadata, MLARows
from npu_vllm_bridge.attention.mla_context_parallel import plan_mla_dcp
from npu_vllm_bridge.attention.tasks import run_mla_decode

HEADS, RANK, NOPE, ROPE, V = 2, 32, 16, 16, 16  # this rank's heads; 4 gathered
SIZE, INTERLEAVE = 2, 4
BLOCK, NUM_BLOCKS, WIDTH, TOKENS = 16, 64, 4, 6
SPEC = MLASpec(HEADS, RANK, NOPE, ROPE, V, BLOCK, torch.float32)
LAYER = "model.layers.0.self_attn.attn"
ATOL = 2e-5
# Per step (query_lens, seq_lens) of the real requests, graph-padded to TOKENS rows.
STEPS = [
    ([1, 1, 1, 1], [40, 3, 27, 15]),
    ([1, 1, 1, 1], [41, 4, 28, 16]),
    ([1, 1], [9, 60]),  # 4 padding rows
    ([1, 5], [33, 12]),  # a chunked prefill's rows after 7 cached tokens
]


def test_plan_mla_dcp_gives_each_row_its_rank_share_up_to_its_position():
    query_lens, seq_lens = [1, 3, 0], [10, 7, 0]  # the third request is graph padding
    tables = torch.arange(12, dtype=torch.int32).view(3, 4)
    slots = torch.full((6,), -1, dtype=torch.int64)
    positions, requests = [9, 4, 5, 6], [0, 1, 1, 1]
    for rank in range(SIZE):
        plan = plan_mla_dcp(
            query_lens, seq_lens, tables, slots, 6, SPEC, DCPLayout(SIZE, rank, INTERLEAVE)
        )
        brute = [
            int((dcp_owner(np.arange(p + 1), SIZE, INTERLEAVE) == rank).sum()) for p in positions
        ]
        assert plan.seq_lens_host == [*brute, 0, 0]
        assert plan.cu_seqlens_q_host == list(range(7))
        assert plan.num_decodes == 6 and plan.num_prefills == 0
        assert plan.spec.num_heads == HEADS * SIZE
        assert plan.block_tables[:4].tolist() == tables[requests].tolist()
    with pytest.raises(ValueError, match="hold 7 tokens, above 6"):
        plan_mla_dcp([2, 5], [2, 5], tables[:2], slots, 6, SPEC, DCPLayout(SIZE, 0))


def test_plan_mla_dcp_gathers_the_rows_block_tables_into_one_tensor():
    """A FULL graph's decode task is re-issued on the tensors of its capture: with
    ``table_rows`` every step's plan reads its block tables from that one buffer (the
    simulated NPU refused the new tensor ``index_select`` made each step)."""
    tables = torch.arange(12, dtype=torch.int32).view(3, 4)
    slots = torch.full((6,), -1, dtype=torch.int64)
    table_rows = torch.zeros(8, 4, dtype=torch.int32)
    layout = DCPLayout(SIZE, 0, INTERLEAVE)
    addresses = []
    for query_lens, seq_lens, requests in (([1, 1, 1], [5, 9, 2], [0, 1, 2]),
                                           ([1, 1], [6, 10], [0, 1])):  # fmt: skip
        plan = plan_mla_dcp(query_lens, seq_lens, tables[: len(query_lens)], slots, 6, SPEC,
                            layout, table_rows=table_rows)  # fmt: skip
        assert plan.block_tables[: len(requests)].tolist() == tables[requests].tolist()
        addresses.append((plan.block_tables.data_ptr(), tuple(plan.block_tables.shape)))
    assert addresses[0] == addresses[1] == (table_rows.data_ptr(), (6, 4))
    for wrong in (torch.zeros(5, 4, dtype=torch.int32), torch.zeros(8, 4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="table_rows must be"):
            plan_mla_dcp([1], [5], tables[:1], slots, 6, SPEC, layout, table_rows=wrong)


class _Rank:
    """One rank: its cache, its captured decode, its registry."""

    def __init__(self, rank: int):
        self.layout = DCPLayout(SIZE, rank, INTERLEAVE)
        self.cache = allocate_latent_cache(NUM_BLOCKS, SPEC)
        self.registry = TaskRegistry("attention", expected_tasks=1)
        self.current: dict = {}
        self.q_latent = torch.zeros(TOKENS, HEADS * SIZE, RANK)
        self.q_rope = torch.zeros(TOKENS, HEADS * SIZE, ROPE)
        self.graph = GraphWrapper(self._decode, backend="host", tasks=self.registry)

    def _decode(self, _):
        metadata = self.current["metadata"]
        out = self.q_latent.new_zeros(TOKENS, HEADS * SIZE, RANK)
        lse = torch.full((TOKENS, HEADS * SIZE), float("-inf"))
        run_mla_decode(
            self.q_latent * 1.0, self.q_rope * 1.0, self.cache, out, lse, metadata,
            layer_name=LAYER,
        )  # fmt: skip
        return out * 1.0, lse * 1.0

    def load(self, step, latents, tables, query):
        query_lens, seq_lens = step
        padded_q = [*query_lens, *[0] * (TOKENS - len(query_lens))]
        padded_s = [*seq_lens, *[0] * (TOKENS - len(seq_lens))]
        self.cache.kv_c.fill_(float("nan"))
        self.cache.k_pe.fill_(float("nan"))
        for i, seq in enumerate(seq_lens):
            pos = np.arange(seq)
            mine = dcp_owner(pos, SIZE, INTERLEAVE) == self.layout.rank
            slots = dcp_slot_mapping(
                pos, np.full(seq, i), tables.numpy(), BLOCK, SIZE, self.layout.rank, INTERLEAVE
            )[mine]
            rows = latents[i][torch.from_numpy(np.flatnonzero(mine))]
            self.cache.kv_c.view(-1, RANK)[torch.from_numpy(slots)] = rows[:, :RANK]
            self.cache.k_pe.view(-1, ROPE)[torch.from_numpy(slots)] = rows[:, RANK:]
        plan = plan_mla_dcp(
            padded_q, padded_s, torch.vstack([tables, tables])[:TOKENS],
            torch.full((TOKENS,), -1, dtype=torch.int64), TOKENS, SPEC, self.layout,
            provider="reference",
        )  # fmt: skip
        self.current["metadata"] = BridgeMLAMetadata(
            plan, TOKENS, TOKENS, TOKENS, TOKENS, 0, MLARows(TOKENS, TOKENS), None
        )
        self.q_latent.copy_(query[0])
        self.q_rope.copy_(query[1])


def _oracle(step, latents, query) -> torch.Tensor:
    query_lens, seq_lens = step
    out, row = torch.zeros(TOKENS, HEADS * SIZE, RANK, dtype=torch.float64), 0
    for i, (q, seq) in enumerate(zip(query_lens, seq_lens)):
        for t in range(q):
            keys = latents[i][: seq - q + t + 1].double()
            scores = query[0][row].double() @ keys[:, :RANK].T
            scores += query[1][row].double() @ keys[:, RANK:].T
            out[row] = torch.softmax(scores * SPEC.softmax_scale, -1) @ keys[:, :RANK]
            row += 1
    return out


def _errors(update: bool) -> list[float]:
    generator = torch.Generator().manual_seed(5)
    ranks = [_Rank(r) for r in range(SIZE)]
    errors = []
    for index, step in enumerate(STEPS):
        n = len(step[0])
        tables = (torch.randperm(NUM_BLOCKS - 1, generator=generator)[: n * WIDTH] + 1).view(
            n, WIDTH
        )
        latents = [torch.randn(s, RANK + ROPE, generator=generator) for s in step[1]]
        query = (
            torch.randn(TOKENS, HEADS * SIZE, RANK, generator=generator),
            torch.randn(TOKENS, HEADS * SIZE, ROPE, generator=generator),
        )
        parts = []
        for rank in ranks:
            rank.load(step, latents, tables, query)
            if index and update:
                rank.registry.update("dcp", {LAYER: rank.current["metadata"]})
            with graph_dispatch(RuntimeMode.FULL, "dcp"):
                parts.append(rank.graph(None))
        merged, _ = merge_attention_states(
            torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts])
        )
        rows = sum(step[0])
        expected = _oracle(step, latents, query)
        diff = (merged[:rows].double() - expected[:rows]).abs()
        errors.append(float(torch.nan_to_num(diff, nan=float("inf")).max()))  # NaN: stale pages
        for out, lse in parts:  # graph-padding rows see no key on any rank
            if update or not index:
                assert torch.isneginf(lse[rows:]).all() and (out[rows:] == 0).all()
    return errors


def test_each_rank_update_makes_the_merged_replay_match_the_oracle():
    errors = _errors(update=True)
    assert max(errors) < ATOL, errors


def test_a_skipped_rank_update_is_caught():
    errors = _errors(update=False)
    assert errors[0] < ATOL
    assert min(errors[1:]) > 1e-2, errors
