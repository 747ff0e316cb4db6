"""Dense K/V quantized into 8-bit pages (``--kv-cache-dtype`` of the attention benchmarks).

The codes and scales are ``npu_attention.kv_quant``'s (vLLM's kinds): a per-tensor
scale of absmax / 448 (what a calibrated checkpoint brings) or a scale per token and
KV head; laid into pages along the same block tables as the 16-bit cache.
"""

from __future__ import annotations

import torch

from npu_attention import kv_quant
from npu_attention.kv_quant import KVScales, ScaleKind


def page_rows(rows: torch.Tensor, block_size: int, block_tables: torch.Tensor) -> torch.Tensor:
    """Lay ``rows`` ``[batch, seq, *inner]`` (seq a multiple of ``block_size``) into a new
    ``[num_blocks, block_size, *inner]`` cache along ``block_tables``; block 0 is zero."""
    batch, seq, *inner = rows.shape
    num_blocks = 1 + int(block_tables.max())
    cache = torch.zeros(num_blocks, block_size, *inner, dtype=rows.dtype, device=rows.device)
    for b in range(batch):
        cache[block_tables[b].long()] = rows[b].reshape(seq // block_size, block_size, *inner)
    return cache


def quantized_pages(
    key: torch.Tensor,
    value: torch.Tensor,
    block_size: int,
    block_tables: torch.Tensor,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor, KVScales]:
    """``key``/``value`` ``[batch, kv_heads, seq, d]`` as 8-bit pages of ``kind``:
    ``(key_cache, value_cache, scales)``."""
    caches, scales = [], []
    for dense in (key, value):
        rows = dense.transpose(1, 2)  # [batch, seq, kv_heads, d]
        if kv_quant.scale_kind(kind) is ScaleKind.PER_TENSOR:
            scale = (dense.abs().amax().float() / kv_quant.FP8_MAX).reshape(1)
            codes = torch.stack([kv_quant.quantize_per_tensor(r, scale) for r in rows])
            caches.append(page_rows(codes, block_size, block_tables))
            scales.append(scale)
            continue
        dtype = kv_quant.cache_dtype(kind, dense.dtype)
        pairs = [kv_quant.quantize_per_token_head(r, dtype) for r in rows]  # per request
        codes = torch.stack([c for c, _ in pairs])
        caches.append(page_rows(codes, block_size, block_tables))
        scales.append(page_rows(torch.stack([s for _, s in pairs]), block_size, block_tables))
    return caches[0], caches[1], KVScales(scales[0], scales[1])
