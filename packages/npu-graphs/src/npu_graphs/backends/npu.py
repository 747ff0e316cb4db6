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
* a task whose step did not change is only released: its event is recorded.

With ``auto_dispatch=True`` (torch_npu builds that accept ``auto_dispatch_capture``),
torch_npu groups the ops it knows itself (fused infer attention, paged attention)
and ``NPUGraph.update(cpu_update_input=[...])`` re-issues them with new keyword
arguments; each updatable task must then hold exactly one such op.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from npu_graphs.backends.base import GraphBackend, TaskUpdate
from npu_graphs.planner import NPU_STREAM_BUDGET, graphs_within_stream_budget


@dataclass(frozen=True)
class NpuTaskHandle:
    """A captured task group and the external event that gates the replay on its update."""

    group: Any  # what graph_task_group_end returned; None on the auto-dispatch path
    event: Any  # torch.npu.ExternalEvent; None on the auto-dispatch path
    index: int  # position among the graph's task groups


class NpuGraphBackend(GraphBackend):
    """Graphs of NPU work, with per-task host-argument update.

    Args:
        auto_dispatch: capture with ``auto_dispatch_capture=True`` and update through
            ``NPUGraph.update(cpu_update_input=...)`` (needs a torch_npu that has it).
        capture_error_mode: passed to ``torch.npu.graph``.
        stream_budget: streams the device offers to graphs (for ``max_graphs``).
    """

    name = "npu"
    device_type = "npu"
    supports_task_update = True
    weak_ref_outputs = False  # outputs stay owned: torch_npu has no public weak-ref view
    capture_executes = False
    warmup_runs = 1

    def __init__(
        self,
        *,
        auto_dispatch: bool = False,
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
        if auto_dispatch and not self.has_auto_dispatch():
            raise ValueError(
                "auto_dispatch=True needs torch.npu.graph(auto_dispatch_capture=...) and "
                "NPUGraph.update(cpu_update_input=...), which this torch_npu lacks"
            )
        self.auto_dispatch = auto_dispatch
        self.capture_error_mode = capture_error_mode
        self.stream_budget = stream_budget
        self._update_stream: Any = None
        self._replay_done: Any = None
        self._replayed = False
        self._capturing: Any = None
        self._groups: dict[int, int] = {}
        self._auto_inputs: dict[int, list[dict[str, Any]]] = {}

    @staticmethod
    def has_auto_dispatch() -> bool:
        """True if the installed torch_npu offers the auto-dispatch capture and update."""
        graph_init = inspect.signature(torch.npu.graph.__init__).parameters
        return "auto_dispatch_capture" in graph_init and hasattr(torch.npu.NPUGraph, "update")

    # -- graphs -----------------------------------------------------------------------
    def new_graph(self) -> Any:
        return torch.npu.NPUGraph()

    def new_pool(self) -> Any:
        return torch.npu.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, graph: Any, *, pool: Any = None, stream: Any = None) -> Iterator[None]:
        extra = {"auto_dispatch_capture": True} if self.auto_dispatch else {}
        self._capturing = graph
        self._groups[id(graph)] = 0
        self._auto_inputs[id(graph)] = []
        try:
            with torch.npu.graph(
                graph,
                pool=pool,
                stream=stream,
                capture_error_mode=self.capture_error_mode,
                **extra,
            ):
                yield
        except BaseException:
            self._groups.pop(id(graph), None)
            self._auto_inputs.pop(id(graph), None)
            raise
        finally:
            self._capturing = None

    def replay(self, graph: Any, inputs: Any = None) -> None:  # reads captured addresses
        stream = torch.npu.current_stream()
        graph.replay()
        if self._replay_done is None:
            self._replay_done = torch.npu.Event()
        self._replay_done.record(stream)
        self._replayed = True

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
        if self.auto_dispatch:
            return None
        event = torch.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        torch.npu.graph_task_group_begin(stream)
        return event

    def task_group_end(
        self, graph: Any, stream: Any, token: Any, host_values: Mapping[str, Any] | None = None
    ) -> NpuTaskHandle:
        index = self._groups.get(id(graph), 0)
        self._groups[id(graph)] = index + 1
        if self.auto_dispatch:
            self._auto_inputs.setdefault(id(graph), []).append(dict(host_values or {}))
            return NpuTaskHandle(None, None, index)
        group = torch.npu.graph_task_group_end(stream)
        return NpuTaskHandle(group, token, index)

    def update_tasks(self, graph: Any, updates: Sequence[TaskUpdate]) -> None:
        if self.auto_dispatch:
            self._update_auto(graph, updates)
            return
        stream = self._ordered_update_stream()
        with torch.npu.stream(stream):
            for handle, issue in updates:
                if issue is not None:
                    torch.npu.graph_task_update_begin(stream, handle.group)
                    issue()
                    torch.npu.graph_task_update_end(stream)
                handle.event.record(stream)

    def _ordered_update_stream(self) -> Any:
        """The update stream, made to wait for the last replay (its tasks may still run)."""
        if self._update_stream is None:
            self._update_stream = torch.npu.Stream()
        if self._replayed:
            self._update_stream.wait_event(self._replay_done)
        return self._update_stream

    def _update_auto(self, graph: Any, updates: Sequence[TaskUpdate]) -> None:
        inputs = self._auto_inputs[id(graph)]  # one dict per task, captured values first
        for handle, issue in updates:
            if issue is not None:
                inputs[handle.index] = dict(issue.host_values)
        graph.update(cpu_update_input=inputs)

    # -- memory -----------------------------------------------------------------------
    def memory_in_use(self) -> int:
        free, total = torch.npu.mem_get_info()
        return total - free

    def max_graphs(self, num_layers: int) -> int | None:
        return graphs_within_stream_budget(num_layers, self.stream_budget)
