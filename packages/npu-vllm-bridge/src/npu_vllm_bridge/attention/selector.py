"""The one path from vLLM's attention selector to a bridge backend (GQA or MLA)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from npu_vllm_bridge.attention.backend import NPUBridgeAttentionBackend, NPUBridgeMLABackend
from npu_vllm_bridge.attention.capabilities import attention_head_sizes
from npu_vllm_bridge.settings import PREFIX
from npu_vllm_bridge.vllm_seam import selector_fields

if TYPE_CHECKING:
    from vllm.v1.attention.selector import AttentionSelectorConfig

_HEAD_SIZE_REASON = "head_size not supported"


def backend_for_selector(selector: AttentionSelectorConfig) -> str:
    """The class path of the bridge backend serving the layer vLLM asks for, registered
    as vLLM's ``CUSTOM`` backend.

    Raises:
        ValueError: the layer is one the bridge cannot serve (sparse attention, sinks,
            a head size, block size or KV-cache dtype, ...), with every reason vLLM's
            ``validate_configuration`` gives.
    """
    if selector.use_sparse:
        kind = (
            "sparse MLA layers (DeepSeek-V3.2's indexer, index_topk)"
            if selector.use_mla
            else ("sparse attention layers")
        )
        raise ValueError(f"{PREFIX} does not support {kind}")
    backend = NPUBridgeMLABackend if selector.use_mla else NPUBridgeAttentionBackend
    reasons = backend.validate_configuration(device_capability=None, **selector_fields(selector))
    if _HEAD_SIZE_REASON in reasons:
        provider, head_sizes = attention_head_sizes()
        reasons[reasons.index(_HEAD_SIZE_REASON)] = (
            f"{_HEAD_SIZE_REASON} by the {provider!r} attention provider "
            f"(its head sizes: {list(head_sizes)})"
        )
    if reasons:
        kind = "MLA" if selector.use_mla else "attention"
        width = "latent width" if selector.use_mla else "head_size"
        raise ValueError(
            f"{PREFIX} {kind} cannot serve this layer ({width}={selector.head_size}, "
            f"dtype={selector.dtype}, kv_cache_dtype={selector.kv_cache_dtype}, "
            f"block_size={selector.block_size}, attn_type={selector.attn_type}): "
            + "; ".join(reasons)
        )
    return backend.register()
