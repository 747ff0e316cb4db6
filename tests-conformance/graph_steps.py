"""Two decode steps of ascend attention over one paged cache, for graph tests.

Step 2 appends one token to every request: a graph captured at step 1 and
replayed at step 2 without a task update reads stale lengths, which shows up as
a wrong output. ``expected`` runs the reference provider eagerly.
"""

from __future__ import annotations

import torch
from ascend_cases import DTYPE_TOLERANCE, Case, build_batch

from npu_attention import AttentionSpec, BatchState, plan, register_provider, run

CASE = Case("graph_decode", BatchState.DECODE_ONLY, (0, 100, 300), (1, 1, 1), num_decodes=3)
TOLERANCE = DTYPE_TOLERANCE[CASE.dtype]


class Steps:
    """Two decode steps over one cache: step 2 appends one token to every request."""

    def __init__(self) -> None:
        register_provider("ascend-graph", "ascend_cases:HostAscendProvider")
        self.batch = build_batch(CASE)
        self.spec: AttentionSpec = CASE.spec
        self.key_cache = self.batch.key_cache.clone()
        self.value_cache = self.batch.value_cache.clone()
        self.query = self.batch.query.clone()  # the graph's static input
        self.out = torch.zeros_like(self.query)  # the graph's static output

    def plan(self, step: int, provider: str = "ascend-graph"):
        seq_lens = [n + step - 1 for n in self.batch.seq_lens]
        size = self.spec.block_size
        slots = [
            int(self.batch.block_tables[r, (n - 1) // size]) * size + (n - 1) % size
            for r, n in enumerate(seq_lens)
        ]
        return plan(
            self.batch.cu_seqlens_q,
            seq_lens,
            self.batch.block_tables,
            torch.tensor(slots),
            CASE.num_decodes,
            self.spec,
            provider=provider,
        )

    def write_step(self, step: int, generator_seed: int) -> torch.Tensor:
        """Eagerly write step ``step``'s K/V; return its query."""
        generator = torch.Generator().manual_seed(generator_seed)
        shape = (3, CASE.num_kv_heads, CASE.head_size)
        key = torch.randn(*shape, generator=generator).to(CASE.dtype)
        value = torch.randn(*shape, generator=generator).to(CASE.dtype)
        self.plan(step).provider.write_kv(
            key, value, self.key_cache, self.value_cache, self.plan(step)
        )
        return torch.randn(self.query.shape, generator=generator).to(CASE.dtype)

    def expected(self, step: int) -> torch.Tensor:
        out = torch.zeros_like(self.query)
        run(
            self.query,
            None,
            None,
            self.key_cache,
            self.value_cache,
            self.plan(step, "reference"),
            out,
        )
        return out

    def attend(self, step_plan) -> None:
        step_plan.provider.attend(self.query, self.key_cache, self.value_cache, step_plan, self.out)
