"""MLA decode context parallelism: each DCP rank attends in latent space over its share
of every request's latents and returns the log-sum-exp; ``merge_attention_states``
of the ranks' parts must equal unsharded attention, computed by a float64 oracle.

The layout is vLLM's: the ranks share one block table, and rank ``r`` keeps the
global positions ``dcp_owner(p) == r`` at its local positions ``0, 1, 2, ...``. Every
query row is its own one-token request (``plan_context`` with an ``MLASpec``) whose
KV length is the number of the rank's positions up to the row's own, so the rows of a
chunked prefill stay causal; padded rows get length 0 (LSE ``-inf``, zeros).

Providers: ``reference`` on the CPU, ``triton`` through Triton's interpreter on the
CPU (small widths) and on a GPU (``cuda`` marks, DeepSeek widths, 1 and several KV
splits). Tolerances: ``mla_cases.MLA_TOLERANCE`` for outputs, the same for the LSE.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mla_cases import MLA_TOLERANCE, SMALL_SPEC
from triton_interpreter import DEVICE, HAS_CUDA

from npu_attention import get_provider, merge_attention_states, plan_context
from npu_attention.context_parallel import dcp_local_seq_lens, dcp_owner, dcp_slot_mapping
from npu_attention.mla import MLASpec, allocate_latent_cache, mla_decode

# (query_lens, context_lens): decodes, a prefix-cache hit, a chunked prefill, a short one
BATCHES = {
    "decode_only": ([1, 1, 1, 1], [0, 1, 40, 7]),
    "chunked_prefill": ([1, 6, 13], [30, 11, 0]),
    "prefill_cache_hit": ([3, 9], [21, 2]),
}
PAD_ROWS = 2


def _spec(dtype: torch.dtype = torch.float32, **overrides) -> MLASpec:
    return MLASpec(**{**SMALL_SPEC, "block_size": 16, "dtype": dtype, **overrides})


class _Batch:
    """Random latents of every request (context and new tokens, all in the cache:
    vLLM writes the step's latents before it attends) and one query per row."""

    def __init__(self, spec, query_lens, context_lens, device, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.spec, self.device = spec, device
        self.seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        self.request = np.repeat(np.arange(len(query_lens)), query_lens)
        self.position = np.concatenate(
            [np.arange(c, c + q) for q, c in zip(query_lens, context_lens)]
        )
        rows = len(self.position) + PAD_ROWS

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(spec.dtype).to(device)

        self.latents = [rand(s, spec.latent_dim) for s in self.seq_lens]
        self.q_latent = rand(rows, spec.num_heads, spec.kv_lora_rank)
        self.q_rope = rand(rows, spec.num_heads, spec.qk_rope_head_dim)
        bs = spec.block_size
        width = max(-(-s // bs) for s in self.seq_lens) + 1
        pages = 1 + np.random.default_rng(seed).permutation(len(self.seq_lens) * width)
        self.tables = pages.reshape(len(self.seq_lens), width).astype(np.int64)
        self.num_blocks = int(pages.max()) + 1

    def rank_cache(self, dcp_size: int, rank: int, interleave: int):
        """Rank ``rank``'s latent cache: NaN but for its share of every request."""
        spec, bs = self.spec, self.spec.block_size
        cache = allocate_latent_cache(self.num_blocks, spec, self.device)
        cache.kv_c.fill_(float("nan"))
        cache.k_pe.fill_(float("nan"))
        for i, seq in enumerate(self.seq_lens):
            pos = np.arange(seq)
            mine = dcp_owner(pos, dcp_size, interleave) == rank
            slots = dcp_slot_mapping(
                pos, np.full(seq, i), self.tables, bs, dcp_size, rank, interleave
            )[mine]
            keep = torch.from_numpy(np.flatnonzero(mine)).to(self.device)
            kv_c, k_pe = (
                self.latents[i]
                .index_select(0, keep)
                .split([spec.kv_lora_rank, spec.qk_rope_head_dim], -1)
            )
            blocks, offsets = torch.from_numpy(slots // bs), torch.from_numpy(slots % bs)
            cache.kv_c[blocks, offsets] = kv_c
            cache.k_pe[blocks, offsets] = k_pe
        return cache

    def rank_part(self, provider: str, dcp_size: int, rank: int, interleave: int):
        """One rank's latent output ``[rows, N, L]`` and LSE ``[rows, N]``."""
        rows = self.q_latent.shape[0]
        visible = np.concatenate(
            [
                dcp_local_seq_lens(self.position + 1, dcp_size, interleave, rank),
                np.zeros(PAD_ROWS, np.int64),  # graph padding: no key
            ]
        )
        padding_tables = self.tables[:1].repeat(PAD_ROWS, 0)
        tables = torch.from_numpy(np.vstack([self.tables[self.request], padding_tables]))
        step = plan_context(
            np.arange(rows + 1), visible, tables, rows, self.spec, device=self.device,
            provider=provider,
        )  # fmt: skip
        out = torch.full_like(self.q_latent, float("nan"))
        lse = torch.full((rows, self.spec.num_heads), float("nan"), device=self.device)
        cache = self.rank_cache(dcp_size, rank, interleave)
        mla_decode(self.q_latent, self.q_rope, cache, step, out, lse=lse)
        return out, lse

    def oracle(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unsharded causal attention of each real row in float64: out and LSE."""
        spec, lat = self.spec, self.spec.kv_lora_rank
        outs, lses = [], []
        for t, (i, p) in enumerate(zip(self.request, self.position)):
            keys = self.latents[i][: p + 1].double().cpu()
            q = torch.cat([self.q_latent[t], self.q_rope[t]], -1).double().cpu()
            scores = (q @ keys.T) * spec.softmax_scale
            outs.append(scores.softmax(-1) @ keys[:, :lat])
            lses.append(torch.logsumexp(scores, -1))
        return torch.stack(outs), torch.stack(lses)


def _merged(batch: _Batch, provider: str, dcp_size: int, interleave: int):
    parts = [batch.rank_part(provider, dcp_size, r, interleave) for r in range(dcp_size)]
    outputs = torch.stack([o.float() for o, _ in parts])
    lses = torch.stack([lse for _, lse in parts])
    return merge_attention_states(outputs, lses), parts


def _check(batch: _Batch, provider: str, dcp_size: int, interleave: int) -> None:
    (out, lse), parts = _merged(batch, provider, dcp_size, interleave)
    want_out, want_lse = batch.oracle()
    real = len(batch.position)
    tol = MLA_TOLERANCE[batch.spec.dtype]
    torch.testing.assert_close(out[:real].double().cpu(), want_out, **tol)
    torch.testing.assert_close(lse[:real].double().cpu(), want_lse, **tol)
    for part_out, part_lse in parts:  # padded rows see no key on any rank
        assert torch.isneginf(part_lse[real:]).all()
        assert (part_out[real:] == 0).all()


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize(("dcp_size", "interleave"), [(1, 1), (2, 1), (3, 2), (2, 16)])
def test_reference_shards_merged_equal_unsharded_attention(
    batch_name: str, dcp_size: int, interleave: int
) -> None:
    query_lens, context_lens = BATCHES[batch_name]
    batch = _Batch(_spec(), query_lens, context_lens, torch.device("cpu"))
    _check(batch, "reference", dcp_size, interleave)


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize(("dcp_size", "interleave", "splits"), [(1, 1, 1), (2, 1, 3), (3, 2, 1)])
def test_triton_shards_merged_equal_unsharded_attention(
    batch_name: str, dcp_size: int, interleave: int, splits: int
) -> None:
    pytest.importorskip("triton")
    provider = get_provider("triton", DEVICE, family="mla")
    saved = provider.fixed_kv_splits
    provider.fixed_kv_splits = splits
    try:
        query_lens, context_lens = BATCHES[batch_name]
        _check(_Batch(_spec(), query_lens, context_lens, DEVICE), "triton", dcp_size, interleave)
    finally:
        provider.fixed_kv_splits = saved


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_deepseek_widths_shards_merged(splits: int | None, dtype: torch.dtype) -> None:
    provider = get_provider("triton", DEVICE, family="mla")
    saved = provider.fixed_kv_splits
    provider.fixed_kv_splits = splits
    try:
        spec = MLASpec(
            num_heads=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, block_size=64, dtype=dtype,
        )  # fmt: skip
        batch = _Batch(spec, [1, 1, 1, 5], [700, 3, 260, 90], DEVICE, seed=3)
        _check(batch, "triton", 2, 16)
    finally:
        provider.fixed_kv_splits = saved


def test_lse_is_refused_by_a_provider_that_cannot_write_it(monkeypatch) -> None:
    batch = _Batch(_spec(), [1, 1], [3, 5], torch.device("cpu"))
    provider = get_provider("reference", torch.device("cpu"), family="mla")
    monkeypatch.setattr(type(provider), "returns_lse", False)
    with pytest.raises(ValueError, match="does not return the log-sum-exp"):
        batch.rank_part("reference", 1, 0, 1)


def test_bad_lse_shapes_and_dtypes_are_refused() -> None:
    batch = _Batch(_spec(), [1, 1], [3, 5], torch.device("cpu"))
    visible = [4, 6, 0, 0]
    tables = torch.from_numpy(np.vstack([batch.tables, batch.tables]))
    step = plan_context(np.arange(5), visible, tables, 4, batch.spec)
    cache = batch.rank_cache(1, 0, 1)
    out = torch.zeros_like(batch.q_latent)
    with pytest.raises(ValueError, match=r"lse must have shape \[>= num_decode_tokens=4, 4\]"):
        mla_decode(batch.q_latent, batch.q_rope, cache, step, out, lse=torch.zeros(2, 4))
    with pytest.raises(TypeError, match="lse must have dtype torch"):
        mla_decode(batch.q_latent, batch.q_rope, cache, step, out, lse=torch.zeros(4, 4).half())


def test_plan_context_refuses_mla_requests_of_several_tokens() -> None:
    tables = torch.zeros((2, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match="decodes of one query token each"):
        plan_context([0, 1, 3], [4, 2], tables, 2, _spec())
    with pytest.raises(ValueError, match="num_decodes = every request"):
        plan_context([0, 1, 2], [4, 2], tables, 1, _spec())
