"""Name -> provider class registries; providers are chosen by name or by device.

Two families share the names and the device preferences: ``"attention"``
(``npu_attention.providers.base.AttentionProvider``, for ``AttentionSpec``) and
``"mla"`` (``npu_attention.providers.mla_base.MLAProvider``, for
``npu_attention.mla.MLASpec``).

Providers are registered as ``"module:Class"`` strings and imported on first use, so
that torch_npu / triton are imported only when their provider is chosen; this module
imports no provider itself (the providers sit above ``plan``, which chooses through here).
"""

from __future__ import annotations

from typing import Any

import torch

# name -> "module:Class"
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
_INSTANCES: dict[str, Any] = {}
_LAZY_MLA_PROVIDERS: dict[str, str] = {
    "reference": "npu_attention.providers.reference_mla:ReferenceMLAProvider",
    "triton": "npu_attention.providers.triton_mla:TritonMLAProvider",
    "ascend": "npu_attention.providers.ascend_mla:AscendMLAProvider",
}
_MLA_DEVICE_PREFERENCE: dict[str, tuple[str, ...]] = dict(_DEVICE_PREFERENCE)
_MLA_INSTANCES: dict[str, Any] = {}
FAMILIES = ("attention", "mla")


def _tables(family: str) -> tuple[dict[str, str], dict[str, tuple[str, ...]], dict[str, Any]]:
    """(lazy targets, device preference, instances) of ``family``, read at call time."""
    if family == "attention":
        return _LAZY_PROVIDERS, _DEVICE_PREFERENCE, _INSTANCES
    if family == "mla":
        return _LAZY_MLA_PROVIDERS, _MLA_DEVICE_PREFERENCE, _MLA_INSTANCES
    raise ValueError(f"provider family must be one of {FAMILIES}, got {family!r}")


def register_provider(
    name: str, target: str, device_types: tuple[str, ...] = (), *, family: str = "attention"
) -> None:
    """Register ``"module:Class"`` under ``name`` in ``family``; prefer it for ``device_types``.

    Not used by the vLLM bridge today; for engines that bring a provider of their own
    (and for tests that swap one in)."""
    lazy, preference, instances = _tables(family)
    lazy[name] = target
    instances.pop(name, None)
    for device_type in device_types:
        rest = tuple(n for n in preference.get(device_type, ()) if n != name)
        preference[device_type] = (name, *rest)


def available_providers(family: str = "attention") -> tuple[str, ...]:
    """Names of every registered provider of ``family`` (whether or not it imports here).
    Not used by the vLLM bridge today."""
    return tuple(_tables(family)[0])


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


def returns_lse(name: str, family: str = "attention") -> bool:
    """Whether the provider called ``name`` can return the log-sum-exp (``run(...,
    lse=)``, ``mla_decode(..., lse=)``), which decode context parallelism merges by.

    Like ``supported_head_sizes``, this needs only the provider's class.

    Raises:
        ValueError: unknown name or family.
    """
    return bool(_provider_class(name, family).returns_lse)


def quantized_verify_in_graphs(name: str, family: str = "attention") -> bool:
    """Whether the provider called ``name`` can run a step of several query tokens per
    request (a speculative verify step) over quantized pages as a captured graph task;
    like ``supported_head_sizes``, needs only its class.

    Raises:
        ValueError: unknown name or family.
    """
    return bool(getattr(_provider_class(name, family), "quantized_verify_in_graphs", True))


def supported_kv_cache_dtypes(name: str, family: str = "attention") -> tuple[str, ...]:
    """The ``kv_cache_dtype`` values (``npu_attention.kv_quant``) the provider called
    ``name`` reads and writes; like ``supported_head_sizes``, needs only its class.

    Raises:
        ValueError: unknown name or family.
    """
    return tuple(getattr(_provider_class(name, family), "kv_cache_dtypes", ("auto",)))


def get_provider(
    name: str | None = None,
    device: torch.device | str | None = None,
    *,
    family: str = "attention",
) -> Any:
    """Return the provider of ``family`` called ``name``, or the preferred one for ``device``
    (an ``AttentionProvider``, or an ``MLAProvider`` for ``family="mla"``).

    Raises:
        ValueError: unknown name or family, no provider for the device, or a provider
            asked for on a device it does not support.
    """
    if name is None:
        if device is None:
            raise ValueError("get_provider needs a provider name or a device, got neither")
        return _provider_for_device(torch.device(device), family)
    provider = _instantiate(name, family)
    if device is not None and not provider.supports_device(torch.device(device)):
        raise ValueError(
            f"provider {name!r} runs on {provider.device_types}, "
            f"got tensors on {torch.device(device).type!r}"
        )
    return provider


def _provider_for_device(device: torch.device, family: str = "attention") -> Any:
    preference = _tables(family)[1]
    candidates = preference.get(device.type, ())
    for name in candidates:
        try:
            cls = _provider_class(name, family)
        except ImportError:  # its optional dependency (triton, torch_npu) is missing
            continue
        if cls.is_available():
            return _instantiate(name, family)
    raise ValueError(
        f"no {_label(family)} provider for device type {device.type!r}; "
        f"known device types: {sorted(preference)}, tried: {list(candidates)}"
    )


def _provider_class(name: str, family: str = "attention") -> type:
    lazy = _tables(family)[0]
    if name not in lazy:
        raise ValueError(
            f"unknown {_label(family)} provider {name!r}; expected one of {sorted(lazy)}"
        )
    module_name, class_name = lazy[name].split(":")
    module = __import__(module_name, fromlist=[class_name])
    return getattr(module, class_name)


def _instantiate(name: str, family: str = "attention") -> Any:
    instances = _tables(family)[2]
    if name not in instances:
        cls = _provider_class(name, family)
        if not cls.is_available():
            raise ValueError(f"{_label(family)} provider {name!r} is not available on this machine")
        instances[name] = cls()
    return instances[name]


def _label(family: str) -> str:
    return "attention" if family == "attention" else "MLA attention"
