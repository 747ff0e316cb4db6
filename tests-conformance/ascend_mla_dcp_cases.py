"""Decode context parallelism's MLA steps: every row a one-token request over one DCP
rank's share of the latents (``plan_context`` with an ``MLASpec``), at DeepSeek widths.

The layout is vLLM's: the ranks share one block table, and rank ``r`` keeps the
global positions ``dcp_owner(p) == r`` at its local positions ``0, 1, 2, ...``. A
row's KV length is the number of the rank's positions up to the row's own, so the
rows of a chunked prefill stay causal; ``PAD_ROWS`` padding rows get length 0.
"""

from __future__ import annotations

import numpy as np
import torch
from ascend_mla_cases import LATENT, NOPE, ROPE, VALUE

from npu_attention import plan_context
from npu_attention.context_parallel import dcp_local_seq_lens, dcp_owner, dcp_slot_mapping
from npu_attention.mla import MLASpec, allocate_latent_cache, mla_decode

PAD_ROWS = 2
# (query_lens, context_lens): decodes (one with no context), a chunked prefill, a prefix hit
BATCHES = {
    "decode_only": ([1, 1, 1, 1], [0, 1, 150, 7]),
    "chunked_prefill": ([1, 6, 13], [30, 11, 0]),
    "prefill_cache_hit": ([3, 9], [21, 2]),
}


def mla_spec(num_heads: int, block_size: int, dtype: torch.dtype) -> MLASpec:
    return MLASpec(
        num_heads=num_heads,
        kv_lora_rank=LATENT,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=VALUE,
        block_size=block_size,
        dtype=dtype,
    )


class DcpBatch:
    """Random latents of every request (all in the cache, as vLLM writes the step's
    latents before it attends) and one query per row, plus ``PAD_ROWS`` padding rows."""

    def __init__(self, spec: MLASpec, query_lens, context_lens, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.spec = spec
        self.seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        self.request = np.repeat(np.arange(len(query_lens)), query_lens)
        self.position = np.concatenate(
            [np.arange(c, c + q) for q, c in zip(query_lens, context_lens)]
        )
        rows = len(self.position) + PAD_ROWS

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(spec.dtype)

        self.latents = [rand(s, LATENT + ROPE) for s in self.seq_lens]
        self.q_latent = rand(rows, spec.num_heads, LATENT)
        self.q_rope = rand(rows, spec.num_heads, ROPE)
        bs = spec.block_size
        width = max(-(-s // bs) for s in self.seq_lens) + 1
        pages = 1 + np.random.default_rng(seed).permutation(len(self.seq_lens) * width)
        self.tables = pages.reshape(len(self.seq_lens), width).astype(np.int64)
        self.num_blocks = int(pages.max()) + 1

    def rank_cache(self, size: int, rank: int, interleave: int):
        """Rank ``rank``'s latent cache: NaN but for its share of every request."""
        bs = self.spec.block_size
        cache = allocate_latent_cache(self.num_blocks, self.spec)
        cache.kv_c.fill_(float("nan"))
        cache.k_pe.fill_(float("nan"))
        for i, seq in enumerate(self.seq_lens):
            pos = np.arange(seq)
            mine = dcp_owner(pos, size, interleave) == rank
            slots = dcp_slot_mapping(pos, np.full(seq, i), self.tables, bs, size, rank, interleave)
            keep = torch.from_numpy(np.flatnonzero(mine))
            kv_c, k_pe = self.latents[i].index_select(0, keep).split([LATENT, ROPE], -1)
            blocks = torch.from_numpy(slots[mine] // bs)
            offsets = torch.from_numpy(slots[mine] % bs)
            cache.kv_c[blocks, offsets] = kv_c
            cache.k_pe[blocks, offsets] = k_pe
        return cache

    def rank_plan(self, provider: str, size: int, rank: int, interleave: int):
        rows = self.q_latent.shape[0]
        visible = np.concatenate(
            [
                dcp_local_seq_lens(self.position + 1, size, interleave, rank),
                np.zeros(PAD_ROWS, np.int64),  # graph padding: no key
            ]
        )
        padding_tables = self.tables[:1].repeat(PAD_ROWS, 0)
        tables = torch.from_numpy(np.vstack([self.tables[self.request], padding_tables]))
        return plan_context(
            np.arange(rows + 1), visible, tables, rows, self.spec, provider=provider
        )

    def rank_part(self, provider: str, size: int, rank: int, interleave: int):
        """One rank's latent output ``[rows, N, L]`` and LSE ``[rows, N]``."""
        step = self.rank_plan(provider, size, rank, interleave)
        out = torch.full_like(self.q_latent, float("nan"))
        lse = torch.full((self.q_latent.shape[0], self.spec.num_heads), float("nan"))
        cache = self.rank_cache(size, rank, interleave)
        mla_decode(self.q_latent, self.q_rope, cache, step, out, lse=lse)
        return out, lse

    def oracle(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unsharded causal attention of each real row in float64: out and LSE."""
        outs, lses = [], []
        for t, (i, p) in enumerate(zip(self.request, self.position)):
            keys = self.latents[i][: p + 1].double()
            q = torch.cat([self.q_latent[t], self.q_rope[t]], -1).double()
            scores = (q @ keys.T) * self.spec.softmax_scale
            outs.append(scores.softmax(-1) @ keys[:, :LATENT])
            lses.append(torch.logsumexp(scores, -1))
        return torch.stack(outs), torch.stack(lses)
