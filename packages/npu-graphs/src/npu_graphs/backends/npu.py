"""Ascend NPU graphs through torch_npu (``torch.npu.NPUGraph``), with task update.

Written against torch_npu's published graph API (2.14.0: ``torch_npu/npu/graphs.py``
and ``streams.py``); it has not run on NPU hardware here. Every torch_npu call goes
through ``torch.npu.<name>`` looked up at call time, so that a stand-in module can
check them; torch_npu itself is imported when the backend is created.

Task protocol (explicit task groups, the default):

* capture: ``ExternalEvent`` ``wait`` + ``reset`` on the capture stream, then
  ``graph_task_group_begin(stream)``, the op, ``handle = graph_task_group_end(stream)``;
* update: on a dedicated update stream that first waits for the previous replay
  (an event, not a device-wide synchronize), ``graph_task_update_begin(stream,
  handle)``, the same op with new host arguments, ``graph_task_update_end(stream)``,
  then ``event.record(update_stream)``; the captured ``wait`` orders the replay after it;
* the update may also follow the launch of the replay it is for
  (``updates_follow_replay``): the replay runs up to its first task group and waits
  there for the group's event, so the update overlaps the graph's work. The update
  stream then waits for the replay before that one (waiting for the launched one would
  deadlock: it waits for the update);
* a replay not preceded by an update only releases the tasks: their events are recorded.

torch_npu's other update path (``torch.npu.graph(auto_dispatch_capture=True)`` with
``NPUGraph.update(cpu_update_input=[...])``) is not used.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from npu_graphs.backends.base import GraphBackend, TaskUpdate
from npu_graphs.planner import NPU_STREAM_BUDGET, graphs_within_stream_budget


@dataclass(frozen=True)
class NpuTaskHandle:
    """A captured task group and the external event that gates the replay on its update."""

    group: Any  # what graph_task_group_end returned
    event: Any  # torch.npu.ExternalEvent


class NpuGraphBackend(GraphBackend):
    """Graphs of NPU work, with per-task host-argument update.

    Args:
        capture_error_mode: passed to ``torch.npu.graph``.
        stream_budget: streams the device offers to graphs (for ``max_graphs``).
    """

    name = "npu"
    device_type = "npu"
    supports_task_update = True
    weak_ref_outputs = False  # outputs stay owned: torch_npu has no public weak-ref view
    capture_executes = False
    warmup_runs = 1
    updates_follow_replay = True

    def __init__(
        self,
        *,
        capture_error_mode: str = "global",
        stream_budget: int = NPU_STREAM_BUDGET,
    ) -> None:
        try:
            importlib.import_module("torch_npu")  # registers torch.npu
        except ImportError as exc:
            raise ImportError(
                "the npu graph backend needs torch_npu with Ascend CANN "
                "(pip install 'npu-graphs[ascend]'); use 'cuda' or 'host' elsewhere"
            ) from exc
        self.capture_error_mode = capture_error_mode
        self.stream_budget = stream_budget
        self._update_stream: Any = None
        # Two events, recorded after replays in turn: the last replay's and the one before.
        self._replay_done: tuple[Any, Any] | None = None
        self._replays = 0
        self._capturing: Any = None

    # -- graphs -----------------------------------------------------------------------
    def new_graph(self) -> Any:
        return torch.npu.NPUGraph()

    def new_pool(self) -> Any:
        return torch.npu.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, graph: Any, *, pool: Any = None, stream: Any = None) -> Iterator[None]:
        self._capturing = graph
        try:
            with torch.npu.graph(
                graph, pool=pool, stream=stream, capture_error_mode=self.capture_error_mode
            ):
                yield
        finally:
            self._capturing = None

    def replay(self, graph: Any, inputs: Any = None) -> None:  # reads captured addresses
        stream = torch.npu.current_stream()
        graph.replay()
        if self._replay_done is None:
            self._replay_done = (torch.npu.Event(), torch.npu.Event())
        self._replays += 1
        self._replay_done[self._replays % 2].record(stream)

    def is_capturing(self) -> bool:
        return self._capturing is not None or torch.npu.is_current_stream_capturing()

    def join_capture(self) -> contextlib.AbstractContextManager:
        if self._capturing is None:
            return contextlib.nullcontext()
        return torch.npu.device(torch.npu.current_device())

    def suppress_cache_flush(self) -> contextlib.AbstractContextManager:
        return mock.patch.object(torch.npu, "empty_cache", lambda: None)

    # -- streams and events -----------------------------------------------------------
    def new_stream(self) -> Any:
        return torch.npu.Stream()

    def current_stream(self) -> Any:
        return torch.npu.current_stream()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.npu.stream(stream)

    def new_event(self) -> Any:
        return torch.npu.Event()

    def synchronize(self) -> None:
        torch.npu.synchronize()

    # -- task groups ------------------------------------------------------------------
    def task_group_begin(self, graph: Any, stream: Any) -> Any:
        event = torch.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        torch.npu.graph_task_group_begin(stream)
        return event

    def task_group_end(self, graph: Any, stream: Any, token: Any) -> NpuTaskHandle:
        return NpuTaskHandle(torch.npu.graph_task_group_end(stream), token)

    def update_tasks(self, graph: Any, updates: Sequence[TaskUpdate]) -> None:
        self._issue_updates(self._update_stream_after(self._replays), updates)

    def update_tasks_after_replay(self, graph: Any, updates: Sequence[TaskUpdate]) -> None:
        self._issue_updates(self._update_stream_after(self._replays - 1), updates)

    def _issue_updates(self, stream: Any, updates: Sequence[TaskUpdate]) -> None:
        """Each group's update on ``stream``, its event recorded right after it."""
        with torch.npu.stream(stream):
            for handle, issue in updates:
                if issue is not None:
                    torch.npu.graph_task_update_begin(stream, handle.group)
                    issue()
                    torch.npu.graph_task_update_end(stream)
                handle.event.record(stream)

    def _update_stream_after(self, replay: int) -> Any:
        """The update stream, made to wait for the ``replay``-th replay (from 1; 0: none)
        to finish: its tasks may still run."""
        if self._update_stream is None:
            self._update_stream = torch.npu.Stream()
        if replay > 0:
            self._update_stream.wait_event(self._replay_done[replay % 2])
        return self._update_stream

    # -- memory -----------------------------------------------------------------------
    def memory_in_use(self) -> int:
        free, total = torch.npu.mem_get_info()
        return total - free

    def max_graphs(self, num_layers: int) -> int | None:
        return graphs_within_stream_budget(num_layers, self.stream_budget)
