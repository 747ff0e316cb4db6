"""Graph backends by name or device: ``npu`` (torch_npu), ``cuda`` and ``host`` (CPU).

torch_npu is imported only when the ``npu`` backend is created.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from npu_graphs.backends.base import GraphBackend, TaskUpdate
from npu_graphs.backends.cuda import CudaGraphBackend
from npu_graphs.backends.host import HostGraphBackend
from npu_graphs.backends.npu import NpuGraphBackend

_FACTORIES: dict[str, Callable[[], GraphBackend]] = {}
_INSTANCES: dict[str, GraphBackend] = {}
_DEVICE_TO_BACKEND = {"cpu": "host", "cuda": "cuda", "npu": "npu"}


def register_backend(name: str, factory: Callable[[], GraphBackend]) -> None:
    """Make ``get_backend(name)`` build its backend (once per process) with ``factory()``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"backend name must be a non-empty str, got {name!r}")
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)


def available_backends() -> tuple[str, ...]:
    """Names accepted by :func:`get_backend`."""
    return tuple(sorted(_FACTORIES))


def get_backend(name_or_device: str | torch.device | GraphBackend | None = None) -> GraphBackend:
    """The graph backend for a name (``"npu"``, ``"cuda"``, ``"host"``) or a device.

    Backends are created once per process and shared, so that every graph of a
    backend orders its task updates on one update stream. ``None`` picks by the
    machine: npu if torch_npu's device is present, else cuda if available, else host.
    A device maps by type (``cpu`` -> host). A backend instance is returned as is.

    Raises:
        ValueError: unknown name or device type.
        TypeError: an argument of another type.
    """
    if isinstance(name_or_device, GraphBackend):
        return name_or_device
    if name_or_device is None:
        name = _default_backend_name()
    elif isinstance(name_or_device, torch.device):
        name = _device_backend_name(name_or_device.type)
    elif isinstance(name_or_device, str):
        name = _name_from_text(name_or_device)
    else:
        raise TypeError(
            "expected a backend name, a torch.device, a GraphBackend or None, "
            f"got {type(name_or_device).__name__}"
        )
    backend = _INSTANCES.get(name)
    if backend is None:
        backend = _INSTANCES[name] = _FACTORIES[name]()
    return backend


def _name_from_text(text: str) -> str:
    if text in _FACTORIES:
        return text
    device_type = text.split(":", 1)[0]
    if device_type in _DEVICE_TO_BACKEND:
        return _DEVICE_TO_BACKEND[device_type]
    raise ValueError(
        f"unknown graph backend or device {text!r}; backends: {', '.join(available_backends())}"
    )


def _device_backend_name(device_type: str) -> str:
    if device_type not in _DEVICE_TO_BACKEND:
        raise ValueError(
            f"no graph backend for device type {device_type!r}; "
            f"known: {', '.join(sorted(_DEVICE_TO_BACKEND))}"
        )
    return _DEVICE_TO_BACKEND[device_type]


def _default_backend_name() -> str:
    npu = getattr(torch, "npu", None)
    if npu is not None and getattr(npu, "is_available", lambda: False)():
        return "npu"
    return "cuda" if torch.cuda.is_available() else "host"


register_backend("host", HostGraphBackend)
register_backend("cuda", CudaGraphBackend)
register_backend("npu", NpuGraphBackend)

__all__ = ["GraphBackend", "TaskUpdate", "available_backends", "get_backend", "register_backend"]
