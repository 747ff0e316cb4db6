"""vLLM's ``AttentionBackend`` classes of the bridge: what its attention supports.

One class for GQA/MQA layers (``npu_attention.plan`` / ``run``) and one for MLA layers
(npu-attention's MLA API); both register as vLLM's ``CUSTOM`` backend, the name vLLM's
``Attention`` and ``MLAAttention`` layers look up, and differ only in the impl and
builder they name and in what vLLM's base classes require of them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.v1.attention.backend import AttentionBackend, AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_interface import KVCacheLayout

import npu_attention
from npu_attention.mla.spec import MLA_KV_CACHE_DTYPES
from npu_vllm_bridge.attention.builder import BridgeMetadataBuilder
from npu_vllm_bridge.attention.capabilities import (
    KERNEL_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    attention_head_sizes,
)
from npu_vllm_bridge.attention.impl import BridgeAttentionImpl
from npu_vllm_bridge.attention.kv_cache import SCALE_BYTES
from npu_vllm_bridge.attention.mla_builder import BridgeMLAMetadataBuilder
from npu_vllm_bridge.attention.mla_impl import BridgeMLAImpl

# vLLM's layers look ``get_name()`` up in AttentionBackendEnum: out-of-tree is CUSTOM.
BACKEND_NAME = "CUSTOM"


class BridgeBackendMixin:
    """What both bridge backends declare: dtypes, block sizes, decoder layers only, no
    KV connector, KV cache in the model dtype; and their registration as CUSTOM."""

    supported_dtypes: ClassVar[list[torch.dtype]] = list(SUPPORTED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto"]
    impl_cls: ClassVar[type]
    builder_cls: ClassVar[type]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder_cls

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(KERNEL_BLOCK_SIZES)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def class_path(cls) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"

    @classmethod
    def register(cls) -> str:
        """Register this class as vLLM's ``CUSTOM`` backend (idempotent); its path."""
        register_backend(AttentionBackendEnum.CUSTOM, cls.class_path())
        return cls.class_path()


class NPUBridgeAttentionBackend(BridgeBackendMixin, AttentionBackend):
    """Paged attention through ``npu_attention.plan`` / ``npu_attention.run``.

    Decoder self-attention (causal) over a paged KV cache, with GQA/MQA, sliding
    window and logits soft cap; the KV-cache write happens inside ``forward``.
    """

    forward_includes_kv_cache_update: bool = True
    impl_cls = BridgeAttentionImpl
    builder_cls = BridgeMetadataBuilder
    # Every kind npu-attention defines; the platform's start-up check refuses those its
    # provider does not take (``settings.refuse_kv_cache_dtype``).
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(npu_attention.KV_CACHE_DTYPES)

    @classmethod
    def customize_spec(cls, spec):
        """Per-token-head kinds keep a float32 scale after each head's K row and after
        its V row, as vLLM's Triton backend does: a page of ``2 * (head_size + 4)`` bytes
        per head and token, which vLLM's KV sizing counts."""
        if spec.state_content_bytes is not None or not spec.kv_quant_mode.is_per_token_head:
            return spec
        content = (spec.head_size + spec.head_size_v) * spec.dtype.itemsize + 2 * SCALE_BYTES
        return replace(spec, state_content_bytes=content)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(attention_head_sizes()[1])

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Token-major pages ([block, token, head, K|V]): each token's heads are
        # adjacent, the order Ascend's paged kernels read (BSH per block).
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True


class NPUBridgeMLABackend(BridgeBackendMixin, MLACommonBackend):
    """Multi-head latent attention over a paged latent cache (one row of
    ``kv_lora_rank + qk_rope_head_dim`` per token, vLLM's MLA cache). The latent
    widths a provider takes are checked at start-up, so every head size passes here."""

    impl_cls = BridgeMLAImpl
    builder_cls = BridgeMLAMetadataBuilder
    # The latent cache's kinds (per-tensor fp8, as vLLM's MLA backends take); the
    # platform's start-up check refuses those its MLA provider does not take.
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(MLA_KV_CACHE_DTYPES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any latent width; the provider's limits are checked at start-up
