"""Device-graph capture and replay keyed by batch shape, with per-step task updates.

Parts (each usable alone, none tied to an engine or to attention):

* :func:`get_backend` / :class:`GraphBackend`: ``npu`` (torch_npu graphs with task
  update), ``cuda`` (CUDA graphs, step state in fixed buffers) and ``host`` (recorded
  CPU op streams mirroring the NPU protocol, for CI).
* :class:`GraphWrapper`: capture a callable per batch key on first sight, replay
  after; reads the mode and key set by :func:`graph_dispatch`.
* :class:`TaskRegistry` / :func:`call_task`: ops captured with step arguments that
  ``update(key, step)`` refreshes once per step before replay.
"""

from npu_graphs._version import __version__
from npu_graphs.backends import GraphBackend, available_backends, get_backend, register_backend
from npu_graphs.errors import GraphCaptureError, GraphReplayError, TaskUpdateError
from npu_graphs.modes import DispatchState, RuntimeMode, current_dispatch, graph_dispatch
from npu_graphs.tasks import TaskRegistry, UpdatableTask, call_task
from npu_graphs.wrapper import (
    GraphEntry,
    GraphWrapper,
    capture_quietly,
    shared_capture_stream,
    shared_pool,
)

__all__ = [
    "DispatchState",
    "GraphBackend",
    "GraphCaptureError",
    "GraphEntry",
    "GraphReplayError",
    "GraphWrapper",
    "RuntimeMode",
    "TaskRegistry",
    "TaskUpdateError",
    "UpdatableTask",
    "__version__",
    "available_backends",
    "call_task",
    "capture_quietly",
    "current_dispatch",
    "get_backend",
    "graph_dispatch",
    "register_backend",
    "shared_capture_stream",
    "shared_pool",
]
