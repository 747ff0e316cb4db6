"""What the NPU and host platforms share: the bridge's attention backend and graph wrapper."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from npu_vllm_bridge.settings import BridgeSettings

if TYPE_CHECKING:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

GRAPH_WRAPPER = "npu_vllm_bridge.graphs.wrapper.BridgeGraphWrapper"


class BridgePlatformMixin:
    """Put before vLLM's platform class in the bases: attention and static graphs.

    ``bridge_settings`` is what the attention backend and the graph wiring read
    (``npu_vllm_bridge.settings.current_settings``).
    """

    bridge_settings: ClassVar[BridgeSettings] = BridgeSettings()

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: AttentionBackendEnum,
        attn_selector_config: AttentionSelectorConfig,
        num_heads: int | None = None,
    ) -> str:
        # Imported here: vLLM imports this module while it resolves its platform, and
        # the backend's modules need the resolved platform.
        from npu_vllm_bridge.attention.selector import backend_for_selector

        return backend_for_selector(attn_selector_config)

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return True

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        return GRAPH_WRAPPER
