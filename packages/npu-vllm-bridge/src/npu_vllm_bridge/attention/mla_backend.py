"""The vLLM MLA ``AttentionBackend`` class: DeepSeek-style latent attention through
npu-attention's MLA API (``mla_write_cache``, ``mla_decode``, ``mla_prefill``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

import npu_attention
from npu_vllm_bridge.attention.backend import BACKEND_NAME
from npu_vllm_bridge.platforms.checks import KERNEL_BLOCK_SIZES

if TYPE_CHECKING:
    from vllm.config.cache import CacheDType

    from npu_vllm_bridge.attention.mla_builder import BridgeMLAMetadataBuilder
    from npu_vllm_bridge.attention.mla_impl import BridgeMLAImpl


class NPUBridgeMLABackend(MLACommonBackend):
    """Multi-head latent attention over a paged latent cache (one row of
    ``kv_lora_rank + qk_rope_head_dim`` per token, vLLM's MLA cache).

    Registered as vLLM's ``CUSTOM`` backend when the model uses MLA. The latent
    widths a provider takes are checked at start-up (``platforms/checks.py``), so
    every head size passes here.
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = list(npu_attention.SUPPORTED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[BridgeMLAImpl]:
        from npu_vllm_bridge.attention.mla_impl import BridgeMLAImpl

        return BridgeMLAImpl

    @staticmethod
    def get_builder_cls() -> type[BridgeMLAMetadataBuilder]:
        from npu_vllm_bridge.attention.mla_builder import BridgeMLAMetadataBuilder

        return BridgeMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(KERNEL_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any latent width; the provider's limits are checked at start-up

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False


def register() -> None:
    """Register the MLA backend as vLLM's ``CUSTOM`` attention backend (idempotent)."""
    register_backend(
        AttentionBackendEnum.CUSTOM,
        f"{NPUBridgeMLABackend.__module__}.{NPUBridgeMLABackend.__qualname__}",
    )
