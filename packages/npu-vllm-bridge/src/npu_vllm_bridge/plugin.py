"""vLLM platform-plugin entry point and the ``NPU_BRIDGE_DEVICE`` switch.

vLLM calls :func:`platform_plugin` through the ``vllm.platform_plugins`` entry
point before it picks a platform. Returning ``None`` leaves vLLM untouched.
"""

from __future__ import annotations

import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

DEVICE_ENV = "NPU_BRIDGE_DEVICE"
NPU_PLATFORM = "npu_vllm_bridge.platforms.npu.NPUPlatform"
HOST_PLATFORM = "npu_vllm_bridge.platforms.host.HostPlatform"
_MODES = ("auto", "cpu", "npu")


def requested_mode() -> str:
    """The mode ``NPU_BRIDGE_DEVICE`` asks for: ``auto`` (default), ``cpu`` or ``npu``."""
    mode = os.environ.get(DEVICE_ENV, "").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{DEVICE_ENV} must be one of {_MODES} or unset, got {mode!r}")
    return mode


def npu_unavailable_reason() -> str | None:
    """``None`` when torch_npu imports and sees at least one NPU, else why not."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    try:
        import torch
        import torch_npu  # noqa: F401
    except Exception as exc:  # CANN missing raises OSError/ImportError/RuntimeError
        return f"torch_npu failed to import: {exc}"
    try:
        count = torch.npu.device_count()
    except Exception as exc:
        return f"torch.npu.device_count() failed: {exc}"
    return None if count > 0 else "torch_npu sees no NPU device"


def platform_plugin() -> str | None:
    """Entry point: the platform class path vLLM should use, or ``None``.

    - unset / ``auto``: the NPU platform when an NPU is usable, else ``None``.
    - ``cpu``: the host platform (real vLLM on CPU through the bridge).
    - ``npu``: the NPU platform; raises ``RuntimeError`` when no NPU is usable.
    """
    mode = requested_mode()
    if mode == "cpu":
        return HOST_PLATFORM
    reason = npu_unavailable_reason()
    if reason is None:
        return NPU_PLATFORM
    if mode == "npu":
        message = f"{DEVICE_ENV}=npu but no NPU is usable: {reason}"
        # vLLM swallows exceptions raised by platform plugins; log so it is seen.
        logger.error(message)
        raise RuntimeError(message)
    logger.debug("npu-vllm-bridge inactive: %s", reason)
    return None
