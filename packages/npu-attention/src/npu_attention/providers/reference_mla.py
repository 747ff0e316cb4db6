"""Pure-PyTorch MLA provider: the numerical reference and the CPU path.

It reuses the tiles of the ``reference`` attention provider (batched masked
attention over gathered pages, float32 accumulation; see ``reference.py``):

- decode (absorbed): multi-query attention with one KV head whose keys are the
  cached latent rows ``[kv_c | k_pe]`` and whose values are their ``kv_c`` part;
- prefill (non-absorbed): the pages of the prefill requests are gathered once per
  layer, decompressed by ``kv_up_proj`` into temporary paged keys
  ``[k_nope | k_pe]`` and values ``v`` (one page per request page, shared pages
  repeated), then multi-head causal attention runs over those pages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from npu_attention import kv_quant
from npu_attention.mla.cache import LatentCache
from npu_attention.mla.run import KVUpProjection, up_projected_heads
from npu_attention.mla.spec import MLA_KV_CACHE_DTYPES, MLASpec
from npu_attention.plan import AttentionPlan
from npu_attention.providers.mla_base import MLAProvider, require_cache
from npu_attention.providers.reference import (
    KVWrite,
    Tile,
    _group_tiles,
    _keyless_tokens,
    _kv_write,
    _request_groups,
    _to,
    masked_attention,
)
from npu_attention.spec import AttentionSpec


@dataclass(frozen=True)
class PrefillPages:
    """The prefill requests' pages, decompressed once per layer.

    ``blocks[k]`` is the cache block of compact page ``k``; tiles index compact
    pages, and their query rows count from the first prefill token.
    """

    blocks: torch.Tensor  # int64 [num_pages]
    tiles: tuple[Tile, ...]


@dataclass(frozen=True)
class ReferenceMLAData:
    decode_tiles: tuple[Tile, ...]
    prefill: PrefillPages | None
    kv_write: KVWrite | None
    # int64 rows of requests with KV length 0 (a DCP rank holding none of a request's
    # keys; only decodes can have none): zeros in ``out``, ``-inf`` in ``lse``; None: none
    keyless_rows: torch.Tensor | None = None


class ReferenceMLAProvider(MLAProvider):
    """Vectorized MLA over gathered pages in float32 (see the module doc)."""

    name: ClassVar[str] = "reference"
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    returns_lse: ClassVar[bool] = True
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = MLA_KV_CACHE_DTYPES

    def prepare(self, plan: AttentionPlan) -> ReferenceMLAData:
        require_cache(plan)
        return ReferenceMLAData(
            decode_tiles=decode_tiles(plan),
            prefill=prefill_pages(plan),
            kv_write=_kv_write(plan),
            keyless_rows=_keyless_tokens(plan, plan.host_arrays),
        )

    def write_cache(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        *,
        scale: torch.Tensor | None = None,
    ) -> None:
        target = plan.provider_data.kv_write
        count = target.blocks.shape[0]
        if count == 0:
            return
        if target.tokens is None:
            kv_c, k_pe = kv_c[:count], k_pe[:count]
        else:
            kv_c, k_pe = kv_c.index_select(0, target.tokens), k_pe.index_select(0, target.tokens)
        if scale is not None:
            kv_c = kv_quant.quantize_per_tensor(kv_c, scale)
            k_pe = kv_quant.quantize_per_tensor(k_pe, scale)
        cache.kv_c.index_put_((target.blocks, target.offsets), kv_c)
        cache.k_pe.index_put_((target.blocks, target.offsets), k_pe)

    def decode(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        out: torch.Tensor,
        *,
        lse: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> None:
        spec = plan.spec
        rows = plan.num_decode_tokens
        query = torch.cat([q_latent[:rows], q_rope[:rows]], dim=-1)
        keyless = plan.provider_data.keyless_rows
        if keyless is not None:
            out.index_fill_(0, keyless, 0.0)
            if lse is not None:
                lse.index_fill_(0, keyless, float("-inf"))
        for tile in plan.provider_data.decode_tiles:
            latent = torch.cat(
                [
                    cache.kv_c.index_select(0, tile.kv_blocks),
                    cache.k_pe.index_select(0, tile.kv_blocks),
                ],
                dim=-1,
            ).view(tile.batch, tile.key_len, 1, spec.latent_dim)
            if scale is not None:
                latent = kv_quant.dequantize(latent, scale)
            _attend_tile(query, latent, latent[..., : spec.kv_lora_rank], tile, spec, out, lse)

    def prefill(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        kv_up_proj: KVUpProjection,
        out: torch.Tensor,
        *,
        scale: torch.Tensor | None = None,
    ) -> None:
        pages = plan.provider_data.prefill
        keys, values = decompressed_pages(cache, pages.blocks, plan.spec, kv_up_proj, scale)
        for tile in pages.tiles:
            tile_k = keys.index_select(0, tile.kv_blocks)
            tile_v = values.index_select(0, tile.kv_blocks)
            tile_k = tile_k.view(tile.batch, tile.key_len, *keys.shape[2:])
            tile_v = tile_v.view(tile.batch, tile.key_len, *values.shape[2:])
            _attend_tile(query, tile_k, tile_v, tile, plan.spec, out)


def decode_tiles(plan: AttentionPlan) -> tuple[Tile, ...]:
    """Tiles of the decode requests: MQA over latent rows (one KV head, width L + R)."""
    host = plan.host_arrays
    decodes = np.flatnonzero(
        (host.query_lens[: plan.num_decodes] > 0) & (host.seq_lens[: plan.num_decodes] > 0)
    )
    if not decodes.size:
        return ()
    spec = plan.spec
    proxy = _proxy_spec(spec, num_kv_heads=1, head_size=spec.latent_dim)
    return tuple(_group_tiles(dataclasses.replace(plan, spec=proxy), host, decodes))


def prefill_pages(plan: AttentionPlan) -> PrefillPages | None:
    """The prefill requests' pages (compact, in request order) and tiles over them."""
    host, spec = plan.host_arrays, plan.spec
    groups = [g for g in _request_groups(host, plan.num_decodes) if g[0] >= plan.num_decodes]
    if not groups:
        return None
    requests = np.arange(plan.num_decodes, plan.num_reqs)
    num_pages = -(-host.seq_lens[requests] // spec.block_size)
    first_page = np.concatenate([[0], np.cumsum(num_pages)[:-1]])
    width = int(num_pages.max())
    compact = np.zeros((plan.num_reqs, width), dtype=np.int64)
    columns = np.arange(width)
    compact[requests] = first_page[:, None] + np.minimum(
        columns, np.maximum(num_pages - 1, 0)[:, None]
    )
    table_width = plan.block_tables.shape[1]
    flat = np.repeat(requests, num_pages) * table_width + _ranges(num_pages)
    blocks = plan.block_tables.reshape(-1).index_select(0, _to(flat, plan.device)).long()
    proxy_spec = _proxy_spec(spec, num_kv_heads=spec.num_heads, head_size=spec.qk_head_dim)
    proxy = dataclasses.replace(plan, spec=proxy_spec, block_tables=_to(compact, plan.device))
    shift = plan.num_decode_tokens
    tiles = tuple(
        dataclasses.replace(
            tile, query_tokens=tile.query_tokens - shift, out_tokens=tile.out_tokens - shift
        )
        for group in groups
        for tile in _group_tiles(proxy, host, group)
    )
    return PrefillPages(blocks, tiles)


def decompressed_pages(
    cache: LatentCache,
    blocks: torch.Tensor,
    spec: MLASpec,
    kv_up_proj: KVUpProjection,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[pages, block_size, N, P + R]`` and values ``[pages, block_size, N, V]`` of
    the cache pages ``blocks``, decompressed by ``kv_up_proj`` (an fp8 cache's rows
    dequantized with ``scale`` to ``spec.dtype`` first, as vLLM's MLA prefill gathers
    them).

    Raises:
        TypeError: ``kv_up_proj`` returns another dtype than ``spec.dtype``.
    """
    kv_c = cache.kv_c.index_select(0, blocks).reshape(-1, spec.kv_lora_rank)
    k_pe = cache.k_pe.index_select(0, blocks).reshape(-1, 1, spec.qk_rope_head_dim)
    if scale is not None:
        kv_c = kv_quant.dequantize(kv_c, scale).to(spec.dtype)
        k_pe = kv_quant.dequantize(k_pe, scale).to(spec.dtype)
    k_nope, v = up_projected_heads(kv_up_proj, kv_c, spec)
    if k_nope.dtype != spec.dtype:
        raise TypeError(f"kv_up_proj must return {spec.dtype}, got {k_nope.dtype}")
    keys = torch.cat([k_nope, k_pe.expand(-1, spec.num_heads, -1)], dim=-1)
    shape = (blocks.shape[0], spec.block_size, spec.num_heads)
    return keys.view(*shape, spec.qk_head_dim), v.reshape(*shape, spec.v_head_dim)


def _attend_tile(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tile: Tile,
    spec: MLASpec,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    heads, width = query.shape[1], query.shape[2]
    tile_q = query.index_select(0, tile.query_tokens).view(tile.batch, tile.query_len, heads, width)
    rows = masked_attention(
        tile_q,
        keys,
        values,
        tile.hidden,
        spec.softmax_scale,
        None,
        tile.past_end,
        return_lse=lse is not None,
    )
    if lse is not None:
        rows, row_lse = rows
        if tile.out_rows is not None:
            row_lse = row_lse.index_select(0, tile.out_rows)
        lse.index_copy_(0, tile.out_tokens, row_lse)
    if tile.out_rows is not None:
        rows = rows.index_select(0, tile.out_rows)
    out.index_copy_(0, tile.out_tokens, rows.to(out.dtype))


def _proxy_spec(spec: MLASpec, num_kv_heads: int, head_size: int) -> AttentionSpec:
    """The causal attention spec whose tiles an MLA step reuses."""
    return AttentionSpec(
        num_heads=spec.num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=spec.block_size,
        dtype=spec.dtype,
        scale=spec.softmax_scale,
        num_speculative_tokens=spec.num_speculative_tokens,
    )


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(n) for n in lengths])`` without a Python loop."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total) - starts
