"""Two-rank DCP steps for the bridge's context-parallel tests (a module of its own so
that spawned rank processes can import it)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import torch

from npu_attention import AttentionSpec
from npu_attention.context_parallel import dcp_slot_mapping
from npu_vllm_bridge.attention.context_parallel import DCPLayout, dcp_attention, plan_dcp

DCP, HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 32, 16, 48
LOCAL_HEADS = HEADS // DCP
SPEC = AttentionSpec(LOCAL_HEADS, 1, HEAD_SIZE, BLOCK_SIZE, torch.float32)  # MQA per rank
# (context_len, query_len): decodes first, then prefills with and without context.
REQUESTS = [(40, 1), (3, 1), (70, 1), (0, 1), (9, 5), (0, 6)]
PAD_TOKENS = 2
ATOL = 2e-5


class Step:
    """One step's tensors for every rank: global query/K/V, per-rank caches and slots."""

    def __init__(self, requests, interleave: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.requests, self.interleave = requests, interleave
        self.query_lens = [q for _, q in requests]
        self.seq_lens = [c + q for c, q in requests]
        self.cu = np.concatenate([[0], np.cumsum(self.query_lens)]).tolist()
        self.num_tokens = self.cu[-1] + PAD_TOKENS
        n = self.num_tokens
        self.query = torch.randn(n, HEADS, HEAD_SIZE, generator=g)
        self.key = torch.randn(n, 1, HEAD_SIZE, generator=g)
        self.value = torch.randn(n, 1, HEAD_SIZE, generator=g)
        self.context = [
            (torch.randn(c, 1, HEAD_SIZE, generator=g), torch.randn(c, 1, HEAD_SIZE, generator=g))
            for c, _ in requests
        ]
        # A block-table entry covers BLOCK_SIZE tokens of every rank (a "virtual block").
        width = max(-(-s // (BLOCK_SIZE * DCP)) for s in self.seq_lens)
        ids = torch.randperm(NUM_BLOCKS - 1, generator=g)[: width * len(requests)] + 1
        self.block_tables = ids.view(len(requests), width).to(torch.int32)
        request = np.repeat(np.arange(len(requests)), self.query_lens)
        positions = np.concatenate([np.arange(c, c + q) for c, q in requests])
        self.caches, self.slots = [], []
        tables = self.block_tables.numpy()
        for rank in range(DCP):
            k_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_SIZE), float("nan"))
            v_cache = torch.full_like(k_cache, float("nan"))
            for i, (c, _) in enumerate(requests):
                pos = np.arange(c)
                slots = dcp_slot_mapping(
                    pos, np.full(c, i), tables, BLOCK_SIZE, DCP, rank, interleave
                )
                mine = torch.from_numpy(np.flatnonzero(slots >= 0))
                kept = torch.from_numpy(slots[slots >= 0])
                k_cache[kept // BLOCK_SIZE, kept % BLOCK_SIZE] = self.context[i][0][mine]
                v_cache[kept // BLOCK_SIZE, kept % BLOCK_SIZE] = self.context[i][1][mine]
            self.caches.append((k_cache, v_cache))
            new_slots = dcp_slot_mapping(
                positions, request, tables, BLOCK_SIZE, DCP, rank, interleave
            )
            self.slots.append(torch.from_numpy(np.concatenate([new_slots, [-1] * PAD_TOKENS])))

    def plans(self, rank: int):
        layout = DCPLayout(DCP, rank, self.interleave)
        return plan_dcp(
            self.cu,
            self.query_lens,
            self.seq_lens,
            self.block_tables,
            self.slots[rank],
            len([q for q in self.query_lens if q == 1]),
            SPEC,
            layout,
        )

    def rank_inputs(self, rank: int):
        heads = slice(rank * LOCAL_HEADS, (rank + 1) * LOCAL_HEADS)
        return self.query[:, heads].contiguous(), self.key, self.value, *self.caches[rank]

    def expected(self) -> torch.Tensor:
        """Float64 causal attention of every head over context + new keys."""
        out = torch.zeros(self.num_tokens, HEADS, HEAD_SIZE, dtype=torch.float64)
        for i, (c, q) in enumerate(self.requests):
            rows = slice(self.cu[i], self.cu[i] + q)
            keys = torch.cat([self.context[i][0], self.key[rows]]).double().expand(-1, HEADS, -1)
            vals = torch.cat([self.context[i][1], self.value[rows]]).double().expand(-1, HEADS, -1)
            scores = torch.einsum("qhd,khd->hqk", self.query[rows].double(), keys)
            scores = scores * HEAD_SIZE**-0.5
            visible = torch.arange(c + q)[None, :] <= torch.arange(c, c + q)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
        return out


def gloo_rank(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=DCP
    )
    try:
        step = Step(REQUESTS, 1, seed=11)
        plans = step.plans(rank)
        metadata = {"layer": SimpleNamespace(plan=plans.new_plan, dcp=plans)}
        out = torch.full((step.num_tokens, LOCAL_HEADS, HEAD_SIZE), float("nan"))
        group = SimpleNamespace(world_size=DCP, device_group=dist.group.WORLD)
        dcp_attention(*step.rank_inputs(rank), out, group, metadata["layer"], layer_name="layer")
        queue.put((rank, out.numpy()))  # by value: the process exits after
    finally:
        dist.destroy_process_group()
    queue.close()
    queue.join_thread()
    # Importing vLLM leaves native threads whose teardown at interpreter exit can abort
    # the process after its work is done ("terminate called without an active exception").
    os._exit(0)
