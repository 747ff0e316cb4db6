"""Start-up checks for speculative decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PREFIX = "npu-vllm-bridge"


def check_speculative(vllm_config: VllmConfig) -> None:
    """Refuse the speculative-decoding setups the bridge cannot run (``ValueError``)."""
    if vllm_config.speculative_config is not None:
        raise ValueError(
            f"{PREFIX} does not support speculative decoding yet; remove speculative_config"
        )
