"""Decode context parallelism (DCP) as updatable graph tasks on npu-graphs' host backend.

Two DCP ranks, simulated in one process: each rank's context attention
(``npu_attention.plan_context`` over its share of the KV cache, in its own fixed
``PlanBuffers``, returning the LSE) is an updatable task whose step argument is the
rank's plan; the graph also merges the ranks' outputs by their LSE. The per-rank
context lengths change every step and padded requests get 0. A replay after
``TaskRegistry.update`` equals the eager step; a replay whose update of one rank's
lengths was skipped does not (the host graph bakes host arguments as an NPU task
does), which is how a runner that forgets the update is caught.

This covers npu-attention + npu-graphs alone; the bridge runs DCP inside vLLM in
``test_decode_context_parallel.py``.
"""

from __future__ import annotations

import numpy as np
import torch

import npu_attention
from npu_attention import AttentionSpec, PlanBuffers, merge_attention_states, plan_context
from npu_attention.context_parallel import dcp_local_seq_lens, dcp_owner, dcp_slot_mapping
from npu_graphs import GraphWrapper, RuntimeMode, TaskRegistry, call_task, graph_dispatch

DCP, BLOCK_SIZE, NUM_BLOCKS, BATCH = 2, 16, 40, 4
SPEC = AttentionSpec(4, 1, 32, BLOCK_SIZE, torch.float32)  # MQA, as DCP needs TP > KV heads
# Context lengths of the 4 decode requests per step; None is a padded request.
STEPS = [(40, 3, 77, 15), (41, 4, 78, None), (9, 60, 2, 33)]
TOLERANCE = dict(atol=2e-5, rtol=2e-5)


class Ranks:
    """Both ranks' caches (each holds its share of every request's context) and buffers."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        width = 8  # 200 positions: a rank keeps 100, 7 pages of 16
        pages = torch.randperm(NUM_BLOCKS - 1, generator=self.gen)[: BATCH * width] + 1
        self.tables = pages.view(BATCH, width).to(torch.int64)
        shape = (NUM_BLOCKS, BLOCK_SIZE, 1, 32)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(DCP)]
        self.keys = torch.randn(BATCH, 200, 1, 32, generator=self.gen)
        self.values = torch.randn(BATCH, 200, 1, 32, generator=self.gen)
        for rank, (key_cache, value_cache) in enumerate(self.caches):
            for req in range(BATCH):
                pos = np.arange(200 // DCP * DCP)
                mine = dcp_owner(pos, DCP) == rank
                slots = dcp_slot_mapping(
                    pos, np.full(len(pos), req), self.tables.numpy(), BLOCK_SIZE, DCP, rank
                )[mine]
                slots = torch.from_numpy(slots)
                key_cache.view(-1, 1, 32)[slots] = self.keys[req, torch.from_numpy(pos[mine])]
                value_cache.view(-1, 1, 32)[slots] = self.values[req, torch.from_numpy(pos[mine])]
        self.buffers = [PlanBuffers.allocate(BATCH, BATCH, width) for _ in range(DCP)]
        self.query = torch.zeros(BATCH, 4, 32)  # the graph's static input

    def plans(self, contexts) -> tuple[npu_attention.AttentionPlan, ...]:
        """Each rank's plan of a step, written into that rank's fixed buffers; padded
        requests have no query token and context length 0."""
        real = [c for c in contexts if c is not None]
        cu = list(range(len(real) + 1))
        local = dcp_local_seq_lens(real, DCP)
        return tuple(
            plan_context(
                cu,
                local[:, rank],
                self.tables[: len(real)],
                len(real),
                SPEC,
                provider="reference",
                buffers=self.buffers[rank],
            )
            for rank in range(DCP)
        )

    def expected(self, contexts) -> torch.Tensor:
        """float64 attention of each real request's query over its whole context."""
        rows = []
        for req, ctx in enumerate(c for c in contexts if c is not None):
            q = self.query[req].double()
            k, v = self.keys[req, :ctx, 0].double(), self.values[req, :ctx, 0].double()
            rows.append(torch.softmax(q @ k.T * SPEC.softmax_scale, -1) @ v)
        return torch.stack(rows)


def _context_task(query, key_cache, value_cache, out, lse, *, plan) -> None:
    npu_attention.run(query, None, None, key_cache, value_cache, plan, out, lse=lse)


def _rank_plan(rank: int):
    return lambda step: {"plan": step[rank]}


def _dcp_step(ranks: Ranks, current: dict):
    """The graphed callable: both ranks' context attention as tasks, then the merge."""

    def step(query):
        outs = torch.zeros(DCP, BATCH, 4, 32)
        lses = torch.full((DCP, BATCH, 4), float("-inf"))
        for rank, (key_cache, value_cache) in enumerate(ranks.caches):
            call_task(_context_task, query, key_cache, value_cache, outs[rank], lses[rank],
                      step=current["plans"], derive=_rank_plan(rank))  # fmt: skip
        return merge_attention_states(outs, lses)[0]

    return step


def _run_steps(skip_update_of_rank: int | None) -> list[float]:
    """Capture at step 0, replay the later steps; return each replay's error."""
    ranks, current = Ranks(seed=21), {}
    registry = TaskRegistry("dcp-attention", expected_tasks=DCP)
    graph = GraphWrapper(_dcp_step(ranks, current), backend="host", tasks=registry)
    errors = []
    for index, contexts in enumerate(STEPS):
        real = sum(c is not None for c in contexts)
        ranks.query[:real] = torch.randn(real, 4, 32, generator=ranks.gen)
        ranks.query[real:] = float("nan")  # padded requests: no query token is read
        plans = ranks.plans(contexts)
        if index and skip_update_of_rank is not None:  # the buggy runner: one rank stale
            stale = list(plans)
            stale[skip_update_of_rank] = current["plans"][skip_update_of_rank]
            current["plans"] = tuple(stale)
        else:
            current["plans"] = plans
        if index:
            registry.update("decode-4", current["plans"])
        with graph_dispatch(RuntimeMode.FULL, "decode-4"):
            out = graph(ranks.query)
        error = (out[:real].double() - ranks.expected(contexts)).abs().max()
        errors.append(float(error))
    assert graph.entry("decode-4").replays == len(STEPS) - 1
    return errors


def test_dcp_rank_lengths_updated_per_step_replay_equal_unsharded_attention() -> None:
    errors = _run_steps(skip_update_of_rank=None)
    assert max(errors) < TOLERANCE["atol"] * 10, errors


def test_skipped_update_of_one_rank_lengths_is_caught() -> None:
    """The control: rank 1's task keeps its captured plan (lengths of step 0) while
    its buffers hold the new step: the replays miss unsharded attention."""
    errors = _run_steps(skip_update_of_rank=1)
    assert errors[0] < TOLERANCE["atol"] * 10  # the capture itself ran the right step
    assert min(errors[1:]) > 1e-2, errors
