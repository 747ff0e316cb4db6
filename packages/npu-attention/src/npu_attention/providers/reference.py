"""Pure-PyTorch provider: the numerical oracle and the CPU path.

``prepare`` turns the step into a few *tiles*, each a batch of requests padded
to a common query length ``lq`` and key length ``lk``, with every index and mask
precomputed; ``attend`` runs one batched masked attention per tile, in float32.

Tiling: all decodes form one group (no per-request work); prefills are grouped
by the power-of-two classes of their query and key lengths, so padding wastes
at most about 3/4 of a tile and the number of groups is bounded by
``(log2 max_query_len + 1) * (log2 max_seq_len + 1)``. A group is split further
only to keep a tile's score and gathered-K/V tensors under ``TILE_ELEMENTS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from npu_attention.providers.base import AttentionProvider

if TYPE_CHECKING:
    from npu_attention.plan import AttentionPlan, HostArrays

TILE_ELEMENTS = 1 << 24  # float32 elements of a tile's scores, or of its gathered K
_NO_SPLIT = 1 << 62


@dataclass(frozen=True)
class Tile:
    """``b`` requests padded to ``lq`` query rows and ``lk`` keys.

    Padding rows and keys index real data of the same request (so every value
    read is finite); the mask hides them and ``out_rows`` drops padding rows.
    """

    query_tokens: torch.Tensor  # int64 [b, lq], token of each query row
    kv_blocks: torch.Tensor | None  # int64 [b, lk], cache block of each key (None: no cache)
    kv_offsets: torch.Tensor | None  # int64 [b, lk], offset in that block
    kv_tokens: torch.Tensor | None  # int64 [b, lk], token of each key (no-cache attention)
    hidden: torch.Tensor  # bool [b, 1, 1, lq, lk], True = key not visible
    out_rows: torch.Tensor | None  # int64 [n], real rows of the flat [b * lq]; None = all
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


class ReferenceProvider(AttentionProvider):
    """Vectorized masked attention over gathered pages, float32 accumulation."""

    name: ClassVar[str] = "reference"
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    def prepare(self, plan: AttentionPlan) -> ReferenceData:
        host = plan.host_arrays
        assert host is not None, "plans are made by npu_attention.plan"
        tiles = tuple(
            tile
            for requests in _request_groups(host, plan.num_decodes)
            for tile in _tiles(plan, host, requests)
        )
        return ReferenceData(tiles, _kv_write(plan))

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> None:
        target = plan.provider_data.kv_write
        count = target.blocks.shape[0]
        if count == 0:
            return
        if target.tokens is None:
            key, value = key[:count], value[:count]
        else:
            key, value = key.index_select(0, target.tokens), value.index_select(0, target.tokens)
        key_cache.index_put_((target.blocks, target.offsets), key)
        value_cache.index_put_((target.blocks, target.offsets), value)

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor | None,
        value_cache: torch.Tensor | None,
        plan: AttentionPlan,
        out: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> None:
        spec = plan.spec
        for tile in plan.provider_data.tiles:
            if key_cache is None:
                tile_k, tile_v = key[tile.kv_tokens], value[tile.kv_tokens]
            else:
                tile_k = key_cache[tile.kv_blocks, tile.kv_offsets]
                tile_v = value_cache[tile.kv_blocks, tile.kv_offsets]
            rows = masked_attention(
                query[tile.query_tokens],
                tile_k,
                tile_v,
                tile.hidden,
                spec.softmax_scale,
                spec.logits_soft_cap,
            )
            if tile.out_rows is not None:
                rows = rows.index_select(0, tile.out_rows)
            out.index_copy_(0, tile.out_tokens, rows.to(out.dtype))


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """Batched attention in float32.

    Args:
        query: ``[b, lq, heads, head_size]``.
        key, value: ``[b, lk, kv_heads, head_size]``.
        hidden: bool ``[b, 1, 1, lq, lk]``, True where a key is not visible.

    Returns:
        float32 ``[b * lq, heads, head_size]`` (rows with no visible key are NaN).
    """
    b, lq, heads, head_size = query.shape
    lk, kv_heads = key.shape[1], key.shape[2]
    group = heads // kv_heads
    q = query.to(torch.float32).view(b, lq, kv_heads, group, head_size)
    q = q.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * lq, head_size)
    k = key.to(torch.float32).permute(0, 2, 3, 1)  # [b, kv_heads, head_size, lk]
    v = value.to(torch.float32).permute(0, 2, 1, 3)  # [b, kv_heads, lk, head_size]
    scores = torch.matmul(q, k).mul_(scale)
    if soft_cap is not None:
        scores = scores.div_(soft_cap).tanh_().mul_(soft_cap)
    scores = scores.view(b, kv_heads, group, lq, lk).masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, kv_heads, group * lq, lk)
    out = torch.matmul(probs, v).view(b, kv_heads, group, lq, head_size)
    return out.permute(0, 3, 1, 2, 4).reshape(b * lq, heads, head_size)


def _request_groups(host: HostArrays, num_decodes: int) -> list[np.ndarray]:
    """Requests with query tokens, grouped: all decodes, then prefills by length class."""
    has_query = host.query_lens > 0
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


def _length_class(lengths: np.ndarray) -> np.ndarray:
    return np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)


def _tiles(plan: AttentionPlan, host: HostArrays, requests: np.ndarray) -> list[Tile]:
    """Split one group into tiles under the memory budget."""
    spec = plan.spec
    lq = int(host.query_lens[requests].max())
    lk = int(host.seq_lens[requests].max())
    per_request = max(spec.num_heads * lq * lk, lk * spec.num_kv_heads * spec.head_size)
    per_tile = max(1, TILE_ELEMENTS // per_request)
    if per_tile > 1 or spec.num_heads * lq * lk <= TILE_ELEMENTS:
        return [
            _tile(plan, host, requests[i : i + per_tile], 0, _NO_SPLIT)
            for i in range(0, len(requests), per_tile)
        ]
    # One request is too large on its own: split its query rows.
    rows = max(1, TILE_ELEMENTS // (spec.num_heads * lk))
    return [
        _tile(plan, host, requests[i : i + 1], start, start + rows)
        for i in range(len(requests))
        for start in range(0, int(host.query_lens[requests[i]]), rows)
    ]


def _tile(
    plan: AttentionPlan, host: HostArrays, requests: np.ndarray, row_start: int, row_end: int
) -> Tile:
    """Indices and mask for ``requests``, query rows ``row_start:row_end`` of each."""
    spec = plan.spec
    query_lens = host.query_lens[requests][:, None]
    context_lens = host.context_lens[requests][:, None]
    seq_lens = host.seq_lens[requests][:, None]
    rows = np.arange(row_start, min(row_end, int(query_lens.max())))
    key_len = int(seq_lens.max())
    if spec.causal:  # keys past the last query row's position are never visible
        key_len = min(key_len, int((context_lens + rows[-1]).max()) + 1)
    positions = np.arange(key_len)

    row_valid = rows < query_lens  # [b, lq]
    query_pos = context_lens + rows  # [b, lq]
    visible = row_valid[:, :, None] & (positions < seq_lens)[:, None, :]
    if spec.causal:
        visible &= positions <= query_pos[:, :, None]
    if spec.sliding_window is not None:
        visible &= positions > query_pos[:, :, None] - spec.sliding_window
        if not spec.causal:
            visible &= positions < query_pos[:, :, None] + spec.sliding_window

    starts = host.cu_seqlens_q[requests][:, None]
    query_tokens = starts + np.minimum(rows, query_lens - 1)
    key_pos = np.minimum(positions, seq_lens - 1)  # padding keys repeat a real key
    device = plan.device
    kv_blocks = kv_offsets = None
    if plan.has_cache:
        block_cols = _to(key_pos // spec.block_size, device)
        kv_blocks = plan.block_tables[_to(requests[:, None], device), block_cols].long()
        kv_offsets = _to(key_pos % spec.block_size, device)
    out_rows = np.flatnonzero(row_valid.ravel())
    return Tile(
        query_tokens=_to(query_tokens, device),
        kv_blocks=kv_blocks,
        kv_offsets=kv_offsets,
        kv_tokens=None if plan.has_context else _to(starts + key_pos, device),
        hidden=_to(~visible[:, None, None], device, np.bool_),
        out_rows=None if out_rows.size == row_valid.size else _to(out_rows, device),
        out_tokens=_to(query_tokens.ravel()[out_rows], device),
    )


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
