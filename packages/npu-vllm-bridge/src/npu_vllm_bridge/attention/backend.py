"""The vLLM ``AttentionBackend`` class: what the bridge's attention supports."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_interface import KVCacheLayout

import npu_attention
from npu_vllm_bridge.platforms.checks import KERNEL_BLOCK_SIZES, attention_head_sizes

if TYPE_CHECKING:
    from vllm.config.cache import CacheDType

    from npu_vllm_bridge.attention.builder import BridgeMetadataBuilder
    from npu_vllm_bridge.attention.impl import BridgeAttentionImpl

# vLLM's Attention layer looks ``get_name()`` up in AttentionBackendEnum, so an
# out-of-tree backend lives under the CUSTOM member.
BACKEND_NAME = "CUSTOM"


class NPUBridgeAttentionBackend(AttentionBackend):
    """Paged attention through ``npu_attention.plan`` / ``npu_attention.run``.

    Decoder self-attention (causal) over a paged KV cache, with GQA/MQA, sliding
    window and logits soft cap; the KV-cache write happens inside ``forward``.
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = list(npu_attention.SUPPORTED_DTYPES)
    # The kernels read K/V in the model dtype: no quantized (fp8, int8, ...) caches.
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto"]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[BridgeAttentionImpl]:
        from npu_vllm_bridge.attention.impl import BridgeAttentionImpl

        return BridgeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[BridgeMetadataBuilder]:
        from npu_vllm_bridge.attention.builder import BridgeMetadataBuilder

        return BridgeMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(KERNEL_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # The head sizes of the npu-attention provider the current platform uses.
        return list(attention_head_sizes()[1])

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Token-major pages ([block, token, head, K|V]): each token's heads are
        # adjacent, the order Ascend's paged kernels read (BSH per block).
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False


def register() -> None:
    """Register the backend as vLLM's ``CUSTOM`` attention backend (idempotent)."""
    register_backend(
        AttentionBackendEnum.CUSTOM,
        f"{NPUBridgeAttentionBackend.__module__}.{NPUBridgeAttentionBackend.__qualname__}",
    )
