"""vLLM attention backend over npu-attention: backend class, metadata builder, impl."""

from npu_vllm_bridge.attention.backend import BACKEND_NAME, NPUBridgeAttentionBackend
from npu_vllm_bridge.attention.builder import BridgeAttentionMetadata, BridgeMetadataBuilder
from npu_vllm_bridge.attention.impl import BridgeAttentionImpl
from npu_vllm_bridge.attention.kv_cache import split_kv_cache

__all__ = [
    "BACKEND_NAME",
    "BridgeAttentionImpl",
    "BridgeAttentionMetadata",
    "BridgeMetadataBuilder",
    "NPUBridgeAttentionBackend",
    "split_kv_cache",
]
