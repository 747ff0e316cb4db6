"""Start-up checks for MLA (multi-head latent attention) models and layers.

The bridge serves DeepSeek-V2/V3-style MLA through npu-attention's MLA providers
(``attention/mla_*.py``). What it refuses, naming the provider and the sizes:
sparse MLA (DeepSeek-V3.2's indexer, ``index_topk``), and latent widths, head
counts or dtypes the platform's MLA provider cannot take (its ``check_spec``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import npu_attention

if TYPE_CHECKING:
    from vllm.v1.attention.selector import AttentionSelectorConfig

PREFIX = "npu-vllm-bridge"
# The block size the start-up check plans with when the user chose none; the
# provider's block sizes are checked again with the real one when the layers plan.
DEFAULT_CHECK_BLOCK_SIZE = 16


def check_mla_model(model_config: Any, block_size: int | None = None) -> None:
    """Refuse an MLA model the bridge cannot run (``ValueError`` naming it).

    Args:
        model_config: vLLM's ``ModelConfig`` of a model with ``use_mla``.
        block_size: the KV-cache block size if the user chose one.

    Raises:
        ValueError: sparse MLA (``index_topk``), or an MLA shape the platform's MLA
            provider refuses (message: provider, widths, heads, block size, dtype).
    """
    from npu_attention.mla import MLASpec

    name = model_config.model
    text_config = model_config.hf_text_config
    if getattr(text_config, "index_topk", None) is not None:
        raise ValueError(
            f"{PREFIX} does not support sparse MLA (index_topk={text_config.index_topk}, "
            f"DeepSeek-V3.2's indexer); {name} uses it"
        )
    widths = {
        "num_heads": getattr(text_config, "num_attention_heads", None),
        "kv_lora_rank": getattr(text_config, "kv_lora_rank", None),
        "qk_nope_head_dim": getattr(text_config, "qk_nope_head_dim", None),
        "qk_rope_head_dim": getattr(text_config, "qk_rope_head_dim", None),
        "v_head_dim": getattr(text_config, "v_head_dim", None),
    }
    block_size = block_size or DEFAULT_CHECK_BLOCK_SIZE
    provider = mla_provider_name()
    sizes = ", ".join(f"{key}={value}" for key, value in widths.items())
    try:
        spec = MLASpec(**widths, block_size=block_size, dtype=model_config.dtype)
        npu_attention.get_provider(provider, family="mla").check_spec(spec)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{PREFIX} cannot run the MLA layers of {name} with the {provider!r} MLA "
            f"provider ({sizes}, block_size={block_size}, dtype={model_config.dtype}): "
            f"{error}"
        ) from None


def mla_provider_name() -> str:
    """The npu-attention MLA provider the current platform will use: its
    ``attention_provider``, else the one npu-attention picks for its device type."""
    from vllm.platforms import current_platform

    name = getattr(current_platform, "attention_provider", None)
    if name is not None:
        return name
    return npu_attention.get_provider(device=current_platform.device_type, family="mla").name


def mla_backend_for_selector(selector: AttentionSelectorConfig) -> str:
    """The bridge's MLA backend class path for an MLA layer, or ``ValueError``.

    Registers the MLA backend as vLLM's ``CUSTOM`` backend (the name vLLM's
    ``MLAAttention`` looks up).
    """
    from npu_vllm_bridge.attention.mla_backend import NPUBridgeMLABackend, register

    if selector.use_sparse:
        raise ValueError(
            f"{PREFIX} does not support sparse MLA layers (DeepSeek-V3.2's indexer, index_topk)"
        )
    reasons = NPUBridgeMLABackend.validate_configuration(
        head_size=selector.head_size,
        dtype=selector.dtype,
        kv_cache_dtype=selector.kv_cache_dtype,
        block_size=selector.block_size,
        use_mla=True,
        has_sink=selector.has_sink,
        use_sparse=False,
        use_mm_prefix=selector.use_mm_prefix,
        use_per_head_quant_scales=selector.use_per_head_quant_scales,
        device_capability=None,
        attn_type=selector.attn_type,
        has_sliding_window=selector.has_sliding_window,
        use_non_causal=selector.use_non_causal,
        use_batch_invariant=selector.use_batch_invariant,
        use_kv_connector=selector.use_kv_connector,
        use_pcp=selector.use_pcp,
        use_adaptive_verification=selector.use_adaptive_verification,
        use_dcp=selector.use_dcp,
        use_rswa=selector.use_rswa,
    )
    if reasons:
        raise ValueError(
            f"{PREFIX} MLA cannot serve this layer (latent width={selector.head_size}, "
            f"dtype={selector.dtype}, kv_cache_dtype={selector.kv_cache_dtype}, "
            f"block_size={selector.block_size}): " + "; ".join(reasons)
        )
    register()
    return f"{NPUBridgeMLABackend.__module__}.{NPUBridgeMLABackend.__qualname__}"
