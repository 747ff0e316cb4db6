"""Device-graph capture and replay keyed by batch shape, with per-step task updates.

Parts (each usable alone, none tied to an engine or to attention):

* :func:`get_backend` / :class:`GraphBackend`: ``npu`` (torch_npu graphs with task
  update), ``cuda`` (CUDA graphs, step state in fixed buffers) and ``host`` (recorded
  CPU op streams mirroring the NPU protocol, for CI).
* :class:`GraphWrapper`: capture a callable per batch key on first sight, replay
  after; reads the mode and key set by :func:`graph_dispatch`; ``replay_step(key,
  step)`` replays with the tasks brought to the step, in the backend's order.
* :class:`TaskRegistry` / :func:`call_task`: ops captured with step arguments that
  each step's ``replay_step`` refreshes.
* :func:`plan_capture` / :class:`CapturePlan`: capture sizes, padding, uniform-decode
  sizes, the device's graph budget; :func:`capture_all` captures with a progress bar
  and reports time and memory.
* :class:`MicroBatchRunner`: micro-batches overlapped on threads and streams,
  captured as one graph per split.
"""

from npu_graphs._version import __version__
from npu_graphs.backends import GraphBackend, available_backends, get_backend, register_backend
from npu_graphs.capture import CaptureReport, capture_all
from npu_graphs.errors import GraphCaptureError, GraphReplayError, TaskUpdateError
from npu_graphs.modes import DispatchState, RuntimeMode, current_dispatch, graph_dispatch
from npu_graphs.planner import (
    NPU_STREAM_BUDGET,
    CapturePlan,
    default_capture_sizes,
    graphs_within_stream_budget,
    plan_capture,
)
from npu_graphs.tasks import (
    PerMicroBatch,
    TaskIssue,
    TaskRegistry,
    UpdatableTask,
    call_task,
    micro_batch_scope,
)
from npu_graphs.ubatch import MicroBatchContext, MicroBatchRunner
from npu_graphs.wrapper import (
    GraphEntry,
    GraphWrapper,
    capture_quietly,
    shared_capture_stream,
    shared_pool,
)

__all__ = [
    "NPU_STREAM_BUDGET",
    "CapturePlan",
    "CaptureReport",
    "DispatchState",
    "GraphBackend",
    "GraphCaptureError",
    "GraphEntry",
    "GraphReplayError",
    "GraphWrapper",
    "MicroBatchContext",
    "MicroBatchRunner",
    "PerMicroBatch",
    "RuntimeMode",
    "TaskIssue",
    "TaskRegistry",
    "TaskUpdateError",
    "UpdatableTask",
    "__version__",
    "available_backends",
    "call_task",
    "capture_all",
    "capture_quietly",
    "current_dispatch",
    "default_capture_sizes",
    "get_backend",
    "graph_dispatch",
    "graphs_within_stream_budget",
    "micro_batch_scope",
    "plan_capture",
    "register_backend",
    "shared_capture_stream",
    "shared_pool",
]
