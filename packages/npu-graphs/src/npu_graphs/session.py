"""The capture under way in this process: its graph, key, mode, and what it registered.

One capture runs at a time per process (as on CUDA and NPU). The session is a
process-wide value rather than a context variable so that worker threads issuing
work into the capture (micro-batches) see it too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from npu_graphs.backends.base import GraphBackend
from npu_graphs.errors import GraphCaptureError
from npu_graphs.modes import RuntimeMode

if TYPE_CHECKING:
    from npu_graphs.tasks import TaskRegistry


@dataclass
class CaptureSession:
    """What one capture has registered so far; committed or discarded as a whole."""

    backend: GraphBackend
    graph: Any
    key: Hashable
    mode: RuntimeMode
    stream: Any
    name: str = "graph"
    default_registry: TaskRegistry | None = None
    registries: list[TaskRegistry] = field(default_factory=list)
    # Device tensors handed to tasks as step arguments: they are the fixed buffers.
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    in_task: bool = False

    def join(self, registry: TaskRegistry) -> None:
        if not any(r is registry for r in self.registries):
            self.registries.append(registry)

    def buffer_for(self, value: torch.Tensor) -> torch.Tensor:
        """The fixed buffer for a device step tensor: the tensor itself, kept alive.

        It must come from outside the capture (step inputs do): memory allocated inside
        a capture may be written by the graph's own earlier ops during replay.
        """
        return self.buffers.setdefault(id(value), value)

    def describe(self) -> str:
        return f"{self.name} (key={self.key!r}, mode={self.mode.name})"


_LOCK = threading.Lock()
_ACTIVE: CaptureSession | None = None


def active_session() -> CaptureSession | None:
    """The capture under way, or None."""
    return _ACTIVE


@contextlib.contextmanager
def capture_session(session: CaptureSession) -> Iterator[CaptureSession]:
    """Make ``session`` the active capture for the enclosed block."""
    global _ACTIVE
    with _LOCK:
        if _ACTIVE is not None:
            raise GraphCaptureError(
                f"cannot capture {session.describe()} while {_ACTIVE.describe()} is being captured"
            )
        _ACTIVE = session
    try:
        yield session
    finally:
        with _LOCK:
            _ACTIVE = None
