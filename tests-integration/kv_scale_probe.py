"""Inside an engine's process: the first rows the bridge writes into each layer's 8-bit
cache with per-tensor scales (``fp8`` / ``fp8_e4m3``), read back from vLLM's pages.

``engine_runner.py`` calls :func:`install` before the engine starts (an engine spec with
``"probe": "kv_scale_probe"``) and :func:`collect` after its rounds. Per layer, the
first step that writes rows gives up to ``ROWS`` of them: the K and V the layer handed
to the bridge's impl (float32) and the 8-bit values that landed at the step's slots
(``uint8`` pages seen as ``float8_e4m3fn``, as floats, not scaled). The layer's own
scales are not read here: the test compares the rows with the scales it wrote into the
checkpoint.
"""

from __future__ import annotations

import torch

PER_TENSOR = ("fp8", "fp8_e4m3")
ROWS = 8  # tokens kept per layer (all of their heads)

_rows: dict[str, dict] = {}
_original = None


def install() -> None:
    """Wrap the bridge's GQA impl so that each layer's first written rows are kept."""
    global _original
    from npu_vllm_bridge.attention.impl import BridgeAttentionImpl

    if _original is not None:
        return
    _original = forward = BridgeAttentionImpl.forward

    def probing_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kw):
        keep = (
            attn_metadata is not None
            and key is not None
            and self.kv_cache_dtype in PER_TENSOR
            and layer.layer_name not in _rows
        )
        if keep:
            rows = min(ROWS, attn_metadata.plan.num_actual_tokens)
            given = key[:rows].float().clone(), value[:rows].float().clone()
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kw)
        if keep:
            slots = attn_metadata.plan.slot_mapping[:rows].long().cpu()
            _rows[layer.layer_name] = _read_back(kv_cache, slots, self.head_size, *given)
        return result

    BridgeAttentionImpl.forward = probing_forward


def _read_back(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    head_size: int,
    key: torch.Tensor,
    value: torch.Tensor,
) -> dict:
    """vLLM's logical page ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` holds
    K then V in the last dim (the bridge's ``packed`` pages, its host default)."""
    block_size = kv_cache.shape[2]
    rows = kv_cache[slots // block_size, :, slots % block_size]  # [rows, kv_heads, 2 * head]
    stored = rows.view(torch.float8_e4m3fn).float()
    return {
        "key": key.tolist(),
        "value": value.tolist(),
        "stored_key": stored[..., :head_size].tolist(),
        "stored_value": stored[..., head_size:].tolist(),
    }


def collect() -> dict:
    """The rows kept per layer name; the bridge's impl is unwrapped."""
    global _original
    from npu_vllm_bridge.attention.impl import BridgeAttentionImpl

    if _original is not None:
        BridgeAttentionImpl.forward = _original
        _original = None
    rows = dict(_rows)
    _rows.clear()
    return rows
