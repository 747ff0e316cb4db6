"""Start-up checks for MLA (multi-head latent attention) models and layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.attention.selector import AttentionSelectorConfig

PREFIX = "npu-vllm-bridge"


def check_mla_model(model_config) -> None:
    """Refuse an MLA model the bridge cannot run (``ValueError`` naming it)."""
    raise ValueError(
        f"{PREFIX} does not support MLA (multi-head latent attention) models; "
        f"{model_config.model} uses MLA"
    )


def mla_backend_for_selector(selector: AttentionSelectorConfig) -> str:
    """The bridge's MLA backend class path for an MLA layer, or ``ValueError``."""
    raise ValueError(f"{PREFIX} does not support MLA (multi-head latent attention) layers")
