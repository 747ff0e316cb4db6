"""Start-up checks for context parallelism (DCP and PCP)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PREFIX = "npu-vllm-bridge"


def check_context_parallel(vllm_config: VllmConfig) -> None:
    """Refuse the context-parallel setups the bridge cannot run (``ValueError``)."""
    parallel = vllm_config.parallel_config
    for option in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, option, 1) > 1:
            raise ValueError(f"{PREFIX} does not support context parallelism ({option} > 1)")
