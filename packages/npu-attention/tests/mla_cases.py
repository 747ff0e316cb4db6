"""MLA test batches over paged latent caches, and an independent float64 MLA oracle.

An ``MLACase`` holds every request's full latent rows (context + new) unpaged and
the kv_b up-projection weight; ``MLACase.paged`` lays the context into a cache
whose pages are a random permutation of blocks ``1..`` (block 0 never used) and
whose unused memory is NaN. The oracle computes attention one request and one
query at a time in float64, the decode rows both ways: absorbed (latent space) and
as the decompressed attention they stand for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from npu_attention_cases import lengths_on_device

from npu_attention import AttentionPlan, PlanBuffers, plan
from npu_attention.mla import (
    LatentCache,
    MLASpec,
    allocate_latent_cache,
    mla_decode,
    mla_prefill,
    mla_write_cache,
    split_latent_cache,
)

# Tolerance of the kernels (float32 accumulation, outputs rounded to dtype) against
# the float64 oracle fed the same dtype-rounded inputs; outputs are O(1).
MLA_TOLERANCE = {
    torch.float32: dict(atol=3e-5, rtol=3e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
SMALL_SPEC = dict(
    num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24
)


@dataclass
class MLACase:
    spec: MLASpec
    query_lens: list[int]
    context_lens: list[int]
    num_decodes: int
    latents: list[torch.Tensor]  # per request [seq_len, L + R]: kv_c | k_pe
    kv_b_weight: torch.Tensor  # [N * (P + V), L], each head's rows k_nope then v
    q_latent: torch.Tensor  # [num_decode_tokens + pad, N, L]
    q_rope: torch.Tensor  # [num_decode_tokens + pad, N, R]
    query: torch.Tensor  # [num_prefill_tokens + pad, N, P + R]
    pad_tokens: int

    @property
    def seq_lens(self) -> list[int]:
        return [q + c for q, c in zip(self.query_lens, self.context_lens)]

    @property
    def cu_seqlens_q(self) -> list[int]:
        return [0, *np.cumsum(self.query_lens).tolist()]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_decode_tokens(self) -> int:
        return sum(self.query_lens[: self.num_decodes])

    def kv_up_proj(self, kv_c: torch.Tensor) -> torch.Tensor:
        """vLLM's kv_b_proj: ``[n, L] -> [n, N * (P + V)]`` in the cache dtype."""
        return kv_c @ self.kv_b_weight.to(kv_c.device).T

    def new_latents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's new ``kv_c`` ``[tokens + pad, L]`` and ``k_pe`` ``[tokens + pad, R]``."""
        rows = [lat[c:] for lat, c in zip(self.latents, self.context_lens)]
        width = self.spec.latent_dim
        pad = self.q_rope.new_full((self.pad_tokens, width), 7.0)
        new = torch.cat([*rows, pad]) if rows else pad
        return new.split([self.spec.kv_lora_rank, self.spec.qk_rope_head_dim], dim=-1)

    def paged(self, rng: np.random.Generator, layout: str = "planes") -> MLAPaged:
        """A NaN-filled cache holding the context; block tables and new tokens' slots.

        ``layout``: ``"planes"`` (two contiguous planes) or ``"interleaved"`` (views
        of vLLM's ``[blocks, block_size, L + R]``).
        """
        spec, bs = self.spec, self.spec.block_size
        blocks_per_req = [-(-s // bs) for s in self.seq_lens]
        num_blocks = 1 + sum(blocks_per_req) + 2
        pages = 1 + rng.permutation(num_blocks - 1)
        tables = np.zeros((len(self.seq_lens), max(blocks_per_req, default=0) + 1), np.int64)
        start = 0
        for i, n in enumerate(blocks_per_req):
            tables[i, :n] = pages[start : start + n]
            start += n
        cache = _nan_cache(spec, num_blocks, layout, self.q_rope.device)
        slots = []
        for i, (ctx, seq) in enumerate(zip(self.context_lens, self.seq_lens)):
            pos = np.arange(seq)
            req_slots = tables[i, pos // bs] * bs + pos % bs
            blocks = torch.from_numpy(req_slots[:ctx] // bs)
            offsets = torch.from_numpy(req_slots[:ctx] % bs)
            kv_c, k_pe = self.latents[i][:ctx].split([spec.kv_lora_rank, spec.qk_rope_head_dim], -1)
            cache.kv_c[blocks, offsets] = kv_c
            cache.k_pe[blocks, offsets] = k_pe
            slots.extend(req_slots[ctx:].tolist())
        slots.extend([-1] * self.pad_tokens)
        return MLAPaged(
            torch.from_numpy(tables), torch.tensor(slots, dtype=torch.int64), cache, num_blocks
        )


@dataclass
class MLAPaged:
    block_tables: torch.Tensor  # int64 [num_reqs, width], host
    slot_mapping: torch.Tensor  # int64 [num_tokens + pad], host
    cache: LatentCache
    num_blocks: int


def make_mla_case(
    spec: MLASpec,
    query_lens: list[int],
    context_lens: list[int],
    num_decodes: int,
    *,
    seed: int = 0,
    pad_tokens: int = 0,
    device: str | torch.device = "cpu",
) -> MLACase:
    """Random latents, queries and up-projection, rounded to ``spec.dtype``."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(spec.dtype).to(device)

    n, lat, rope = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    decode_tokens = sum(query_lens[:num_decodes])
    prefill_tokens = sum(query_lens) - decode_tokens
    width = spec.qk_nope_head_dim + spec.v_head_dim
    return MLACase(
        spec=spec,
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        num_decodes=num_decodes,
        latents=[rand(s, spec.latent_dim) for s in seq_lens],
        kv_b_weight=rand(n * width, lat, scale=lat**-0.5),
        q_latent=rand(decode_tokens + pad_tokens, n, lat),
        q_rope=rand(decode_tokens + pad_tokens, n, rope),
        query=rand(prefill_tokens + pad_tokens, n, spec.qk_head_dim),
        pad_tokens=pad_tokens,
    )


def _decode_scores(case: MLACase):
    """Each decode row's scaled scores ``[N, keys]`` and visible latents ``[keys, L +
    R]``, in float64 on the CPU, row by row."""
    for i in range(case.num_decodes):
        latent = case.latents[i].double().cpu()
        start = case.cu_seqlens_q[i]
        for t in range(case.query_lens[i]):
            visible = latent[: case.context_lens[i] + t + 1]
            q = torch.cat([case.q_latent[start + t], case.q_rope[start + t]], -1).double().cpu()
            yield (q @ visible.T) * case.spec.softmax_scale, visible


def oracle_decode(case: MLACase) -> torch.Tensor:
    """Absorbed attention of the decode rows in float64: ``[decode_tokens, N, L]``."""
    spec, lat = case.spec, case.spec.kv_lora_rank
    rows = [scores.softmax(-1) @ visible[:, :lat] for scores, visible in _decode_scores(case)]
    return torch.stack(rows) if rows else torch.zeros(0, spec.num_heads, lat, dtype=torch.float64)


def oracle_decode_lse(case: MLACase) -> torch.Tensor:
    """Natural-log log-sum-exp of each decode row's scaled scores: ``[decode_tokens, N]``."""
    return torch.stack([torch.logsumexp(scores, -1) for scores, _ in _decode_scores(case)])


def decompressed(case: MLACase, request: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[seq, N, P + R]`` and values ``[seq, N, V]`` of a request in float64, the
    up-projection rounded to the dtype as the kernels' ``kv_up_proj`` is."""
    spec = case.spec
    latent = case.latents[request].double().cpu()
    kv_c, k_pe = latent.split([spec.kv_lora_rank, spec.qk_rope_head_dim], -1)
    projected = (kv_c @ case.kv_b_weight.double().cpu().T).to(spec.dtype).double()
    heads = projected.view(-1, spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim)
    k_nope, v = heads.split([spec.qk_nope_head_dim, spec.v_head_dim], -1)
    k_pe = k_pe[:, None, :].expand(-1, spec.num_heads, -1)
    return torch.cat([k_nope, k_pe], -1), v


def oracle_prefill(case: MLACase) -> torch.Tensor:
    """Decompressed causal attention of the prefill rows in float64: ``[prefill_tokens, N, V]``."""
    spec = case.spec
    rows = []
    first = case.num_decode_tokens
    for i in range(case.num_decodes, len(case.query_lens)):
        keys, values = decompressed(case, i)
        start = case.cu_seqlens_q[i] - first
        for t in range(case.query_lens[i]):
            visible = case.context_lens[i] + t + 1
            q = case.query[start + t].double().cpu()  # [N, P + R]
            scores = torch.einsum("nd,snd->ns", q, keys[:visible]) * spec.softmax_scale
            rows.append(torch.einsum("ns,snd->nd", scores.softmax(-1), values[:visible]))
    empty = torch.zeros(0, spec.num_heads, spec.v_head_dim, dtype=torch.float64)
    return torch.stack(rows) if rows else empty


def run_mla_case(
    case: MLACase,
    *,
    provider: str | None = "reference",
    layout: str = "planes",
    seed: int = 0,
    buffers=None,
    device_lengths: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, MLAPaged, AttentionPlan]:
    """plan + cache write + decode + prefill; outputs start as a sentinel (-3).
    ``device_lengths``: the plan takes the lengths from ``lengths_on_device``."""
    paged = case.paged(np.random.default_rng(seed), layout)
    device = case.q_rope.device
    step = plan(
        case.cu_seqlens_q,
        case.seq_lens,
        paged.block_tables.to(device),
        paged.slot_mapping.to(device),
        case.num_decodes,
        case.spec,
        provider=provider,
        buffers=buffers,
        num_blocks=paged.num_blocks if device.type == "cpu" else None,
        device_lengths=lengths_on_device(case, device) if device_lengths else None,
    )
    kv_c, k_pe = case.new_latents()
    mla_write_cache(kv_c, k_pe, paged.cache, step)
    decode_out = torch.full_like(case.q_latent, -3.0)
    prefill_out = case.query.new_full(
        (case.query.shape[0], case.spec.num_heads, case.spec.v_head_dim), -3.0
    )
    mla_decode(case.q_latent, case.q_rope, paged.cache, step, decode_out)
    mla_prefill(case.query, paged.cache, step, case.kv_up_proj, prefill_out)
    return decode_out, prefill_out, paged, step


def assert_mla_matches_oracle(case: MLACase, decode_out: torch.Tensor, prefill_out: torch.Tensor):
    """Real rows within ``MLA_TOLERANCE`` of the oracle; padding rows untouched."""
    tolerance = MLA_TOLERANCE[case.spec.dtype]
    nd, npf = case.num_decode_tokens, case.num_tokens - case.num_decode_tokens
    torch.testing.assert_close(
        decode_out[:nd].cpu().double(), oracle_decode(case), **tolerance, check_dtype=False
    )
    torch.testing.assert_close(
        prefill_out[:npf].cpu().double(), oracle_prefill(case), **tolerance, check_dtype=False
    )
    assert (decode_out[nd:] == -3.0).all(), "decode rows past the decode tokens were written"
    assert (prefill_out[npf:] == -3.0).all(), "prefill rows past the prefill tokens were written"


def assert_latents_written(case: MLACase, paged: MLAPaged) -> None:
    """Each new token's latent sits at its slot; nothing was written elsewhere (still NaN)."""
    bs = case.spec.block_size
    slots = paged.slot_mapping[: case.num_tokens]
    kv_c, k_pe = case.new_latents()
    cache_kv_c, cache_k_pe = paged.cache.kv_c.cpu(), paged.cache.k_pe.cpu()
    torch.testing.assert_close(cache_kv_c[slots // bs, slots % bs], kv_c[: case.num_tokens].cpu())
    torch.testing.assert_close(cache_k_pe[slots // bs, slots % bs], k_pe[: case.num_tokens].cpu())
    written = torch.zeros(paged.num_blocks, bs, dtype=torch.bool)
    for i, seq in enumerate(case.seq_lens):
        pos = torch.arange(seq)
        written[paged.block_tables[i, pos // bs], pos % bs] = True
    assert cache_kv_c[~written].isnan().all(), "kv_c written outside the requests' slots"
    assert cache_k_pe[~written].isnan().all(), "k_pe written outside the requests' slots"


def _nan_cache(spec: MLASpec, num_blocks: int, layout: str, device: torch.device) -> LatentCache:
    if layout == "interleaved":
        shape = (num_blocks, spec.block_size, spec.latent_dim)
        full = torch.full(shape, float("nan"), dtype=spec.dtype, device=device)
        return split_latent_cache(full, spec)
    cache = allocate_latent_cache(num_blocks, spec, device)
    cache.kv_c.fill_(float("nan"))
    cache.k_pe.fill_(float("nan"))
    return cache


def assert_decode_graph_replays(spec: MLASpec, device: str = "cuda") -> None:
    """Decode captured once in a CUDA graph with fixed plan buffers, replayed for the
    next step (other lengths, pages, queries and latents, every unused cache slot NaN):
    each replay matches the oracle of its own step. Decodes of 1 token, block size 16."""
    buffers = PlanBuffers.allocate(4, 4, max_blocks_per_req=64, device=device)
    cache = LatentCache(
        torch.empty(256, 16, spec.kv_lora_rank, dtype=spec.dtype, device=device),
        torch.empty(256, 16, spec.qk_rope_head_dim, dtype=spec.dtype, device=device),
    )
    cases = [
        make_mla_case(spec, [1] * 4, [100, 5, 700, 33], 4, device=device, seed=1),
        make_mla_case(spec, [1] * 4, [900, 250, 2, 64], 4, device=device, seed=2),
    ]
    q_latent, q_rope = cases[0].q_latent.clone(), cases[0].q_rope.clone()
    out = torch.full_like(q_latent, float("nan"))
    graph = torch.cuda.CUDAGraph()
    for index, case in enumerate(cases):
        paged = case.paged(np.random.default_rng(index))
        for plane, pages in zip(cache, paged.cache):
            plane.fill_(float("nan"))
            plane[: paged.num_blocks].copy_(pages)
        tables = torch.zeros(4, 64, dtype=torch.int64)
        tables[:, : paged.block_tables.shape[1]] = paged.block_tables
        step = plan(
            case.cu_seqlens_q,
            case.seq_lens,
            tables.to(device),
            paged.slot_mapping.to(device),
            4,
            spec,
            provider="triton",
            buffers=buffers,
        )
        mla_write_cache(*case.new_latents(), cache, step)
        q_latent.copy_(case.q_latent)
        q_rope.copy_(case.q_rope)
        if index == 0:
            mla_decode(q_latent, q_rope, cache, step, out)  # compile outside the capture
            with torch.cuda.graph(graph):
                mla_decode(q_latent, q_rope, cache, step, out)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(
            out.cpu().double(), oracle_decode(case), **MLA_TOLERANCE[spec.dtype]
        )
