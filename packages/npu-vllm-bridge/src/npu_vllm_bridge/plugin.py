"""vLLM platform-plugin entry point and the ``NPU_BRIDGE_DEVICE`` switch.

vLLM calls :func:`platform_plugin` through the ``vllm.platform_plugins`` entry
point before it picks a platform. Returning ``None`` leaves vLLM untouched.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from npu_vllm_bridge.vllm_version import installed_vllm_version, require_supported_vllm

logger = logging.getLogger(__name__)

DEVICE_ENV = "NPU_BRIDGE_DEVICE"
NPU_PLATFORM = "npu_vllm_bridge.platforms.npu.NPUPlatform"
HOST_PLATFORM = "npu_vllm_bridge.host.platform.HostPlatform"
UNKNOWN_MODE_PLATFORM = "npu_vllm_bridge.plugin.UnknownModePlatform"
UNSUPPORTED_VLLM_PLATFORM = "npu_vllm_bridge.plugin.UnsupportedVllmPlatform"
_MODES = ("auto", "cpu", "npu")
_ALIASES = {"host": "cpu"}  # host mode runs on the CPU


def requested_mode() -> str:
    """The mode ``NPU_BRIDGE_DEVICE`` asks for: ``auto`` (default), ``cpu`` (also
    written ``host``) or ``npu``.

    Raises:
        ValueError: any other value, named in the message.
    """
    mode = os.environ.get(DEVICE_ENV, "").strip().lower() or "auto"
    mode = _ALIASES.get(mode, mode)
    if mode not in _MODES:
        raise ValueError(
            f"{DEVICE_ENV} must be one of {_MODES} (or 'host', the same as 'cpu') or unset, "
            f"got {os.environ.get(DEVICE_ENV)!r}"
        )
    return mode


class UnknownModePlatform:
    """What the plugin names when ``NPU_BRIDGE_DEVICE`` holds an unknown value. vLLM
    swallows errors raised while it asks plugins for their platform, but not those
    raised creating the platform: creating this one raises ``requested_mode``'s
    ``ValueError``, so a mistyped switch stops vLLM instead of leaving it on its own
    platform."""

    def __init__(self) -> None:
        mode = requested_mode()
        raise RuntimeError(f"{DEVICE_ENV} changed to {mode!r} while vLLM chose its platform")


class UnsupportedVllmPlatform:
    """What the plugin names instead of a bridge platform when the installed vLLM is
    not a release the bridge runs on: creating it raises ``require_supported_vllm``'s
    ``RuntimeError`` (the releases taken and the one found) at start-up."""

    def __init__(self) -> None:
        require_supported_vllm()
        raise RuntimeError(
            f"vLLM changed to {installed_vllm_version()} while it chose its platform"
        )


def _bridge_platform(path: str) -> str:
    """``path``, or :data:`UNSUPPORTED_VLLM_PLATFORM` on a vLLM the bridge does not run on."""
    try:
        require_supported_vllm()
    except RuntimeError:
        return UNSUPPORTED_VLLM_PLATFORM
    return path


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
    - anything else: ``UnknownModePlatform``, whose creation raises a ``ValueError``
      naming the value.

    Where it would name a bridge platform on a vLLM other than 0.32 or 0.33, it names
    ``UnsupportedVllmPlatform``, whose creation raises a ``RuntimeError`` naming the
    releases the bridge takes and the one installed.
    """
    try:
        mode = requested_mode()
    except ValueError:
        return UNKNOWN_MODE_PLATFORM
    if mode == "cpu":
        return _bridge_platform(HOST_PLATFORM)
    if mode == "npu":
        return _bridge_platform(NPU_PLATFORM)
    reason = npu_unavailable_reason()
    if reason is None:
        return _bridge_platform(NPU_PLATFORM)
    logger.debug("no NPU platform (%s): vLLM picks its own", reason)
    return None
