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


def require_npu() -> None:
    """Raise ``RuntimeError`` saying why when no NPU is usable.

    The NPU platform module calls this on import: with ``NPU_BRIDGE_DEVICE=npu``
    the plugin names that platform unconditionally, so a missing NPU surfaces
    as this error when vLLM loads the platform (vLLM silently skips plugins that
    raise during detection).
    """
    reason = npu_unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"{DEVICE_ENV}={requested_mode()} asks for the Ascend NPU platform, but no NPU "
            f"is usable: {reason}. Install torch_npu with CANN on an NPU host, or set "
            f"{DEVICE_ENV}=cpu for host mode."
        )


def platform_plugin() -> str | None:
    """Entry point: the platform class path vLLM should use, or ``None``.

    - unset / ``auto``: the NPU platform when an NPU is usable, else ``None``
      (vLLM then picks its own platform as if the bridge were not installed).
    - ``cpu``: the host platform (real vLLM on CPU through the bridge).
    - ``npu``: the NPU platform, unconditionally; loading it raises a
      ``RuntimeError`` naming the cause when no NPU is usable.
    """
    mode = requested_mode()
    if mode == "cpu":
        return HOST_PLATFORM
    if mode == "npu":
        return NPU_PLATFORM
    reason = npu_unavailable_reason()
    if reason is None:
        return NPU_PLATFORM
    logger.debug("npu-vllm-bridge inactive: %s", reason)
    return None
