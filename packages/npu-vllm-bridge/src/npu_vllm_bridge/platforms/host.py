"""Host mode: vLLM's CPU platform with the bridge's attention and graph wiring.

Selected with ``NPU_BRIDGE_DEVICE=cpu``. It runs the same attention backend
(``npu_attention``'s ``reference`` provider) and the same graph capture,
dispatch, task update and replay as the NPU platform, with npu-graphs'
``host`` backend, so both can be developed and tested without an NPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from npu_vllm_bridge.platforms import checks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(__name__)


class HostPlatform(CpuPlatform):
    """vLLM's ``CpuPlatform`` whose attention backend is the bridge's."""

    attention_provider: str = "reference"
    graph_backend: str = "host"

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: AttentionBackendEnum,
        attn_selector_config: AttentionSelectorConfig,
        num_heads: int | None = None,
    ) -> str:
        return checks.backend_for_selector(attn_selector_config)

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        checks.check_model_and_options(vllm_config)
        super().check_and_update_config(vllm_config)
