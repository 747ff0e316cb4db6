"""The capture under way in this process: its backend, graph, key and mode.

One capture runs at a time per process (as on CUDA and NPU). The session is a
process-wide value rather than a context variable so that worker threads issuing
work into the capture (micro-batches) see it too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from npu_graphs.backends.base import GraphBackend
from npu_graphs.errors import GraphCaptureError
from npu_graphs.modes import RuntimeMode


@dataclass(frozen=True)
class CaptureSession:
    """One capture: the graph being captured by ``backend`` on ``stream``, for batch
    ``key`` in ``mode``; ``name`` (the wrapper's) is for messages."""

    backend: GraphBackend
    graph: Any
    key: Hashable
    mode: RuntimeMode
    stream: Any
    name: str = "graph"

    def describe(self) -> str:
        return f"{self.name} (key={self.key!r}, mode={self.mode.name})"


_LOCK = threading.Lock()
_ACTIVE: CaptureSession | None = None


def active_session() -> CaptureSession | None:
    """The capture under way, or None."""
    return _ACTIVE


@contextlib.contextmanager
def capture_session(session: CaptureSession) -> Iterator[CaptureSession]:
    """Make ``session`` the active capture for the enclosed block.

    Raises:
        GraphCaptureError: another capture is under way.
    """
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
