"""Pure-PyTorch provider: the numerical oracle and the CPU path.

``prepare`` turns the step into a few *tiles*, each a batch of requests padded
to a common query length and a common number of whole pages, with every index
and mask precomputed; ``attend`` runs one batched masked attention per tile:
gather pages (``index_select``, any cache strides), float32 scores, soft cap,
mask, softmax, float32 ``P @ V``.

Tiling: all decodes form one group (no per-request work); prefills are grouped
by the power-of-two classes of their query and key lengths, so padding wastes
at most about 3/4 of a tile and the number of groups is bounded by
``(log2 max_query_len + 1) * (log2 max_seq_len + 1)``. A group, sorted by
length, is cut into tiles only to keep a tile's scores and gathered K/V under
``TILE_ELEMENTS`` float32 elements; one request above that alone is split by
query rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from npu_attention import kv_quant
from npu_attention._inputs import HostArrays
from npu_attention.kv_quant import KVScales, ScaleKind
from npu_attention.plan import AttentionPlan
from npu_attention.providers.base import VLLM_HEAD_SIZES, AttentionProvider
from npu_attention.spec import AttentionSpec

TILE_ELEMENTS = 1 << 22  # float32 elements of a tile's scores, or of its gathered K
GROUP_MASK_ELEMENTS = 1 << 24  # a group's masks up to this size are built in one piece


@dataclass(frozen=True)
class Tile:
    """``batch`` requests padded to ``query_len`` query rows and ``key_len`` keys
    (whole pages: ``key_len`` is a multiple of the block size).

    Padding rows and pages index real data of the same request; slots past a
    request's end in its last page may hold anything (NaN included), so their
    values are zeroed (``past_end``). ``hidden`` masks keys, ``out_rows`` drops
    padding rows.
    """

    batch: int
    query_len: int
    key_len: int
    query_tokens: torch.Tensor  # int64 [batch * query_len], token of each query row
    kv_blocks: torch.Tensor | None  # int64 [batch * key_len / block_size] (None: no cache)
    kv_tokens: torch.Tensor | None  # int64 [batch * key_len], token of each key; None if
    # the plan has context (attention without a cache needs context_lens all 0)
    hidden: torch.Tensor  # bool [batch, 1, 1, query_len, key_len], True = key not visible
    past_end: torch.Tensor | None  # bool [batch, 1, key_len, 1], keys past seq_len; None: none
    out_rows: torch.Tensor | None  # int64 [n], real rows of the [batch * query_len]; None = all
    out_tokens: torch.Tensor  # int64 [n], their token indices


@dataclass(frozen=True)
class KVWrite:
    """Where ``write_kv`` puts the step's new keys and values."""

    tokens: torch.Tensor | None  # int64 [n], tokens with a slot; None = the first n tokens
    blocks: torch.Tensor  # int64 [n]
    offsets: torch.Tensor  # int64 [n]


@dataclass(frozen=True)
class ReferenceData:
    tiles: tuple[Tile, ...]
    kv_write: KVWrite
    # int64 query tokens of requests with no key (``plan_context`` with a context
    # length of 0): zeros in ``out``, ``-inf`` in ``lse``; None: there are none
    keyless_tokens: torch.Tensor | None = None


class ReferenceProvider(AttentionProvider):
    """Vectorized masked attention over gathered pages, float32 accumulation."""

    name: ClassVar[str] = "reference"
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    head_sizes: ClassVar[tuple[int, ...]] = VLLM_HEAD_SIZES  # plain PyTorch: any size works
    returns_lse: ClassVar[bool] = True
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = kv_quant.KV_CACHE_DTYPES

    def prepare(self, plan: AttentionPlan) -> ReferenceData:
        host = plan.host_arrays
        assert host is not None, "plans are made by npu_attention.plan"
        tiles = tuple(
            tile
            for requests in _request_groups(host, plan.num_decodes)
            for tile in _group_tiles(plan, host, requests)
        )
        return ReferenceData(tiles, _kv_write(plan), _keyless_tokens(plan, host))

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
        *,
        scales: KVScales | None = None,
    ) -> None:
        target = plan.provider_data.kv_write
        count = target.blocks.shape[0]
        if count == 0:
            return
        if target.tokens is None:
            key, value = key[:count], value[:count]
        else:
            key, value = key.index_select(0, target.tokens), value.index_select(0, target.tokens)
        where = (target.blocks, target.offsets)
        kind = plan.spec.kv_scales
        if kind is ScaleKind.NONE:
            key_cache.index_put_(where, key)
            value_cache.index_put_(where, value)
        elif kind is ScaleKind.PER_TENSOR:
            key_cache.index_put_(where, kv_quant.quantize_per_tensor(key, scales.k))
            value_cache.index_put_(where, kv_quant.quantize_per_tensor(value, scales.v))
        else:
            for rows, cache, scale_cache in (
                (key, key_cache, scales.k),
                (value, value_cache, scales.v),
            ):
                codes, row_scales = kv_quant.quantize_per_token_head(rows, cache.dtype)
                cache.index_put_(where, codes)
                scale_cache.index_put_(where, row_scales)

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor | None,
        value_cache: torch.Tensor | None,
        plan: AttentionPlan,
        out: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        lse: torch.Tensor | None = None,
        scales: KVScales | None = None,
    ) -> None:
        spec = plan.spec
        heads, kv_heads, head_size = spec.num_heads, spec.num_kv_heads, spec.head_size
        keyless = plan.provider_data.keyless_tokens
        if keyless is not None:
            out.index_fill_(0, keyless, 0.0)
            if lse is not None:
                lse.index_fill_(0, keyless, float("-inf"))
        # A quantized cache's own-row prefill attends over the unquantized rows.
        own_rows = key is not None and spec.kv_scales is not ScaleKind.NONE
        for tile in plan.provider_data.tiles:
            kv_shape = (tile.batch, tile.key_len, kv_heads, head_size)
            if key_cache is None or (own_rows and tile.kv_tokens is not None):
                tile_k = key.index_select(0, tile.kv_tokens).view(kv_shape)
                tile_v = value.index_select(0, tile.kv_tokens).view(kv_shape)
            else:
                tile_k = _gather_pages(key_cache, tile.kv_blocks, kv_shape, spec, scales, 0)
                tile_v = _gather_pages(value_cache, tile.kv_blocks, kv_shape, spec, scales, 1)
            tile_q = query.index_select(0, tile.query_tokens)
            rows = masked_attention(
                tile_q.view(tile.batch, tile.query_len, heads, head_size),
                tile_k,
                tile_v,
                tile.hidden,
                spec.softmax_scale,
                spec.logits_soft_cap,
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


def _gather_pages(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    kv_shape: tuple[int, int, int, int],
    spec: AttentionSpec,
    scales: KVScales | None,
    which: int,
) -> torch.Tensor:
    """The pages ``blocks`` of ``cache`` as ``kv_shape`` ``[b, keys, kv_heads, d]``:
    as stored, or float32 ``code * scale`` for a quantized cache (``which``: 0 for the
    keys' scales, 1 for the values')."""
    pages = cache.index_select(0, blocks).view(kv_shape)
    kind = spec.kv_scales
    if kind is ScaleKind.NONE:
        return pages
    scale = scales[which]
    if kind is ScaleKind.PER_TOKEN_HEAD:
        scale = scale.index_select(0, blocks).view(*kv_shape[:3], 1)
    return kv_quant.dequantize(pages, scale)


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    scale: float,
    soft_cap: float | None,
    past_end: torch.Tensor | None = None,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batched attention in float32.

    Args:
        query: ``[b, lq, heads, head_size]``.
        key: ``[b, lk, kv_heads, head_size]``.
        value: ``[b, lk, kv_heads, value_size]`` (``value_size`` may differ, as in MLA).
        hidden: bool ``[b, 1, 1, lq, lk]``, True where a key is not visible.
        past_end: bool ``[b, 1, lk, 1]``, True where ``value`` may be garbage
            (zeroed first, since a hidden key's weight 0 times NaN is NaN).

    Returns:
        float32 ``[b * lq, heads, value_size]`` (rows with no visible key are NaN);
        with ``return_lse``, also the rows' natural-log log-sum-exp of their scores,
        float32 ``[b * lq, heads]``, and rows with no visible key are 0 (LSE ``-inf``).
    """
    b, lq, heads, head_size = query.shape
    lk, kv_heads, value_size = key.shape[1], key.shape[2], value.shape[3]
    group = heads // kv_heads
    q = query.to(torch.float32).view(b, lq, kv_heads, group, head_size)
    q = q.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * lq, head_size)
    k = _float32_heads_first(key)
    v = _float32_heads_first(value)
    if past_end is not None:
        v.masked_fill_(past_end, 0.0)
    scores = torch.matmul(q, k.transpose(2, 3)).mul_(scale)
    if soft_cap is not None:
        scores = scores.div_(soft_cap).tanh_().mul_(soft_cap)
    scores = scores.view(b, kv_heads, group, lq, lk).masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, kv_heads, group * lq, lk)
    if return_lse:
        probs = probs.nan_to_num_(0.0)  # rows with no visible key: 0, not NaN
    out = torch.matmul(probs, v).view(b, kv_heads, group, lq, value_size)
    out = out.permute(0, 3, 1, 2, 4).reshape(b * lq, heads, value_size)
    if not return_lse:
        return out
    lse = torch.logsumexp(scores, dim=-1)  # [b, kv_heads, group, lq]
    return out, lse.permute(0, 3, 1, 2).reshape(b * lq, heads)


def _float32_heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[b, lk, kv_heads, d]`` -> contiguous float32 ``[b, kv_heads, lk, d]`` in one copy."""
    b, lk, kv_heads, head_size = x.shape
    out = torch.empty(b, kv_heads, lk, head_size, dtype=torch.float32, device=x.device)
    return out.copy_(x.permute(0, 2, 1, 3))


def _request_groups(host: HostArrays, num_decodes: int) -> list[np.ndarray]:
    """Requests with query tokens, grouped: all decodes, then prefills by length class."""
    has_query = (host.query_lens > 0) & (host.seq_lens > 0)
    decodes = np.flatnonzero(has_query[:num_decodes])
    groups = [decodes] if decodes.size else []
    prefills = num_decodes + np.flatnonzero(has_query[num_decodes:])
    if prefills.size:
        keys = _length_class(host.query_lens[prefills]) * 64 + _length_class(
            host.seq_lens[prefills]
        )
        order = np.argsort(keys, kind="stable")
        bounds = np.flatnonzero(np.diff(keys[order])) + 1
        groups.extend(np.split(prefills[order], bounds))
    return groups


def _keyless_tokens(plan: AttentionPlan, host: HostArrays) -> torch.Tensor | None:
    """Query tokens of requests that see no key at all (``seq_lens`` 0), or None."""
    keyless = np.flatnonzero((host.seq_lens == 0) & (host.query_lens > 0))
    if keyless.size == 0:
        return None
    starts, ends = host.cu_seqlens_q[keyless], host.cu_seqlens_q[keyless + 1]
    return _to(np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)]), plan.device)


def _length_class(lengths: np.ndarray) -> np.ndarray:
    return np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)


def _group_tiles(plan: AttentionPlan, host: HostArrays, requests: np.ndarray) -> list[Tile]:
    """Tiles of one group: longest sequences first, as many per tile as the budget
    allows; a request too large for a tile on its own is split by query rows."""
    spec = plan.spec
    requests = requests[np.argsort(-host.seq_lens[requests], kind="stable")]
    padded = _round_up(host.seq_lens[requests], spec.block_size)
    alone = spec.num_heads * host.query_lens[requests] * padded > TILE_ELEMENTS
    tiles = [tile for r in requests[alone] for tile in _row_split_tiles(plan, host, r)]
    if not alone.all():
        tiles += _batched_tiles(plan, host, requests[~alone])
    return tiles


def _batched_tiles(plan: AttentionPlan, host: HostArrays, requests: np.ndarray) -> list[Tile]:
    """Group-wide index tensors built once and sliced into tiles (``requests`` sorted
    by decreasing sequence length, so each tile is as short as its first request)."""
    spec, device = plan.spec, plan.device
    query_lens, seq_lens = host.query_lens[requests], host.seq_lens[requests]
    starts = host.cu_seqlens_q[requests]
    query_len = int(query_lens.max())
    rows = np.arange(query_len)
    num_pages = -(-seq_lens // spec.block_size)
    key_len = int(num_pages[0]) * spec.block_size
    token_grid = starts[:, None] + np.minimum(rows, query_lens[:, None] - 1)
    query_tokens = _to(token_grid.ravel(), device)
    pages = _pages(plan, requests, num_pages, int(num_pages[0]))
    kv_tokens = None
    if not plan.has_context:  # keys are the step's own rows: attention without a cache
        key_pos = np.minimum(np.arange(key_len), seq_lens[:, None] - 1)
        kv_tokens = _to(starts[:, None] + key_pos, device)
    masks = None
    if len(requests) * query_len * key_len <= GROUP_MASK_ELEMENTS:
        masks = _masks(spec, host, requests, rows, key_len, device)
    every_row_real = bool((query_lens == query_len).all())
    bounds = list(_tile_bounds(spec, num_pages, query_len))
    tile_blocks = _split_pages(pages, bounds, num_pages)
    tiles = []
    for (first, end), blocks in zip(bounds, tile_blocks):
        part, tokens = slice(first, end), slice(first * query_len, end * query_len)
        keys = int(num_pages[first]) * spec.block_size
        if masks is None:
            hidden, past_end = _masks(spec, host, requests[part], rows, keys, device)
        else:
            hidden, past_end = masks[0][part, ..., :keys], masks[1][part, :, :keys]
        out_rows, out_tokens = None, query_tokens[tokens]
        if not every_row_real:
            real = np.flatnonzero(rows < query_lens[part, None])
            out_rows, out_tokens = _to(real, device), _to(token_grid[part].ravel()[real], device)
        tiles.append(
            Tile(
                batch=end - first,
                query_len=query_len,
                key_len=keys,
                query_tokens=query_tokens[tokens],
                kv_blocks=blocks,
                kv_tokens=None if kv_tokens is None else kv_tokens[part, :keys].reshape(-1),
                hidden=hidden,
                past_end=past_end if (seq_lens[part] < keys).any() else None,
                out_rows=out_rows,
                out_tokens=out_tokens,
            )
        )
    return tiles


def _split_pages(
    pages: torch.Tensor | None, bounds: list[tuple[int, int]], num_pages: np.ndarray
) -> list[torch.Tensor | None]:
    """Each tile's flat block ids (its rows, its first ``num_pages[first]`` columns),
    gathered in one op and split into views."""
    if pages is None:
        return [None] * len(bounds)
    width = pages.shape[1]
    flat = [
        (np.arange(first, end)[:, None] * width + np.arange(num_pages[first])).ravel()
        for first, end in bounds
    ]
    gathered = pages.reshape(-1).index_select(0, _to(np.concatenate(flat), pages.device))
    return list(torch.split(gathered, [len(f) for f in flat]))


def _tile_bounds(
    spec: AttentionSpec, num_pages: np.ndarray, query_len: int
) -> Iterator[tuple[int, int]]:
    """``(first, end)`` request ranges under the budget; ``num_pages`` is decreasing."""
    first = 0
    while first < len(num_pages):
        keys = int(num_pages[first]) * spec.block_size
        per_request = max(
            spec.num_heads * query_len * keys, keys * spec.num_kv_heads * spec.head_size
        )
        end = min(len(num_pages), first + max(1, TILE_ELEMENTS // per_request))
        yield first, end
        first = end


def _row_split_tiles(plan: AttentionPlan, host: HostArrays, request: int) -> list[Tile]:
    """One request in chunks of query rows; causal chunks read only the keys they see."""
    spec, device = plan.spec, plan.device
    query_len, seq_len = int(host.query_lens[request]), int(host.seq_lens[request])
    context_len, start = int(host.context_lens[request]), int(host.cu_seqlens_q[request])
    chunk = max(1, TILE_ELEMENTS // (spec.num_heads * _round_up(seq_len, spec.block_size)))
    requests = np.array([request])
    own_pages = np.array([-(-seq_len // spec.block_size)])
    tiles = []
    for first in range(0, query_len, chunk):
        rows = np.arange(first, min(first + chunk, query_len))
        keys = min(seq_len, context_len + int(rows[-1]) + 1) if spec.causal else seq_len
        tile_pages = -(-keys // spec.block_size)
        tile_keys = tile_pages * spec.block_size
        pages = _pages(plan, requests, own_pages, tile_pages)
        kv_tokens = None
        if not plan.has_context:
            kv_tokens = _to(start + np.minimum(np.arange(tile_keys), seq_len - 1), device)
        hidden, past_end = _masks(spec, host, requests, rows, tile_keys, device)
        query_tokens = _to(start + rows, device)
        tiles.append(
            Tile(
                batch=1,
                query_len=len(rows),
                key_len=tile_keys,
                query_tokens=query_tokens,
                kv_blocks=None if pages is None else pages.reshape(-1),
                kv_tokens=kv_tokens,
                hidden=hidden,
                past_end=past_end if seq_len < tile_keys else None,
                out_rows=None,
                out_tokens=query_tokens,
            )
        )
    return tiles


def _masks(
    spec: AttentionSpec,
    host: HostArrays,
    requests: np.ndarray,
    rows: np.ndarray,
    key_len: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` bool ``[b, 1, 1, len(rows), key_len]`` and ``past_end`` bool
    ``[b, 1, key_len, 1]`` on ``device``."""
    hidden = ~_visible(spec, host, requests, rows, key_len)
    past_end = np.arange(key_len) >= host.seq_lens[requests][:, None]
    return (
        _to(hidden[:, None, None], device, np.bool_),
        _to(past_end[:, None, :, None], device, np.bool_),
    )


def _visible(
    spec: AttentionSpec, host: HostArrays, requests: np.ndarray, rows: np.ndarray, key_len: int
) -> np.ndarray:
    """bool ``[len(requests), len(rows), key_len]``: which key each query row sees."""
    positions = np.arange(key_len)
    query_lens = host.query_lens[requests][:, None]
    query_pos = (host.context_lens[requests][:, None] + rows)[:, :, None]
    visible = (rows < query_lens)[:, :, None] & (positions < host.seq_lens[requests][:, None, None])
    if spec.causal:
        visible &= positions <= query_pos
    if spec.sliding_window is not None:
        visible &= positions > query_pos - spec.sliding_window
        if not spec.causal:
            visible &= positions < query_pos + spec.sliding_window
    return visible


def _pages(
    plan: AttentionPlan, requests: np.ndarray, own_pages: np.ndarray, num_pages: int
) -> torch.Tensor | None:
    """int64 ``[len(requests), num_pages]`` block ids on the plan's device; columns past
    a request's own pages repeat its first page. ``None`` without a cache."""
    if not plan.has_cache:
        return None
    device = plan.device
    pages = plan.block_tables.index_select(0, _to(requests, device))[:, :num_pages].long()
    if (own_pages < num_pages).any():
        own = _to(np.arange(num_pages) < own_pages[:, None], device, np.bool_)
        pages = torch.where(own, pages, pages[:, :1])
    return pages


def _round_up(lengths: np.ndarray, block_size: int) -> np.ndarray:
    return -(-lengths // block_size) * block_size


def _kv_write(plan: AttentionPlan) -> KVWrite:
    """Targets of the step's real tokens that have a slot (slot < 0 is padding).

    On CUDA the compaction is one host sync here, once per step, never in ``run``.
    """
    slots = plan.slot_mapping[: plan.num_actual_tokens]
    tokens = torch.nonzero(slots >= 0).squeeze(1)
    if tokens.shape[0] == slots.shape[0]:
        tokens = None
    else:
        slots = slots[tokens]
    block_size = plan.spec.block_size
    return KVWrite(tokens, slots // block_size, slots % block_size)


def _to(array: np.ndarray, device: torch.device, dtype: type = np.int64) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))
    return tensor if device.type == "cpu" else tensor.to(device)
