"""Name -> provider class registry; providers are chosen by name or by device."""

from __future__ import annotations

import torch

from npu_attention.providers.base import AttentionProvider

# name -> "module:Class"; imported lazily so that torch_npu / triton are only
# imported when their provider is chosen.
_LAZY_PROVIDERS: dict[str, str] = {
    "reference": "npu_attention.providers.reference:ReferenceProvider",
    "triton": "npu_attention.providers.triton:TritonProvider",
    "ascend": "npu_attention.providers.ascend:AscendProvider",
}
# device type -> provider names to try, in order
_DEVICE_PREFERENCE: dict[str, tuple[str, ...]] = {
    "cpu": ("reference",),
    "cuda": ("triton", "reference"),
    "npu": ("ascend",),
}
_INSTANCES: dict[str, AttentionProvider] = {}


def register_provider(name: str, target: str, device_types: tuple[str, ...] = ()) -> None:
    """Register ``"module:Class"`` under ``name``; prefer it for ``device_types``."""
    _LAZY_PROVIDERS[name] = target
    _INSTANCES.pop(name, None)
    for device_type in device_types:
        rest = tuple(n for n in _DEVICE_PREFERENCE.get(device_type, ()) if n != name)
        _DEVICE_PREFERENCE[device_type] = (name, *rest)


def available_providers() -> tuple[str, ...]:
    """Names of every registered provider (whether or not it imports here)."""
    return tuple(_LAZY_PROVIDERS)


def supported_head_sizes(
    name: str | None = None, device: torch.device | str | None = None
) -> tuple[int, ...]:
    """Head sizes the provider called ``name`` (or the preferred one for ``device``)
    accepts, e.g. ``supported_head_sizes("reference")``.

    Naming a provider needs only its class, not its optional dependency (triton,
    torch_npu), so a host can ask what the NPU provider takes.

    Raises:
        ValueError: unknown name, neither name nor device, or no provider for the device.
    """
    if name is None:
        if device is None:
            raise ValueError("supported_head_sizes needs a provider name or a device, got neither")
        return tuple(_provider_for_device(torch.device(device)).head_sizes)
    return tuple(_provider_class(name).head_sizes)


def get_provider(
    name: str | None = None, device: torch.device | str | None = None
) -> AttentionProvider:
    """Return the provider called ``name``, or the preferred one for ``device``.

    Raises:
        ValueError: unknown name, no provider for the device, or a provider asked
            for on a device it does not support.
    """
    if name is None:
        if device is None:
            raise ValueError("get_provider needs a provider name or a device, got neither")
        return _provider_for_device(torch.device(device))
    provider = _instantiate(name)
    if device is not None and not provider.supports_device(torch.device(device)):
        raise ValueError(
            f"provider {name!r} runs on {provider.device_types}, "
            f"got tensors on {torch.device(device).type!r}"
        )
    return provider


def _provider_for_device(device: torch.device) -> AttentionProvider:
    candidates = _DEVICE_PREFERENCE.get(device.type, ())
    for name in candidates:
        try:
            cls = _provider_class(name)
        except ImportError:  # its optional dependency (triton, torch_npu) is missing
            continue
        if cls.is_available():
            return _instantiate(name)
    raise ValueError(
        f"no attention provider for device type {device.type!r}; "
        f"known device types: {sorted(_DEVICE_PREFERENCE)}, tried: {list(candidates)}"
    )


def _provider_class(name: str) -> type[AttentionProvider]:
    if name not in _LAZY_PROVIDERS:
        raise ValueError(
            f"unknown attention provider {name!r}; expected one of {sorted(_LAZY_PROVIDERS)}"
        )
    module_name, class_name = _LAZY_PROVIDERS[name].split(":")
    module = __import__(module_name, fromlist=[class_name])
    return getattr(module, class_name)


def _instantiate(name: str) -> AttentionProvider:
    if name not in _INSTANCES:
        cls = _provider_class(name)
        if not cls.is_available():
            raise ValueError(f"attention provider {name!r} is not available on this machine")
        _INSTANCES[name] = cls()
    return _INSTANCES[name]
