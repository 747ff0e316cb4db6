"""A stand-in for torch_npu's graph API that logs every call, to test the NPU protocol on CPU.

It records the order of the npu backend's calls (names as in torch_npu 2.14.0's
``torch_npu/npu/graphs.py`` and ``streams.py``); captured work runs eagerly and
replays do nothing. It checks nothing of torch_npu's API: the conformance suite
(``tests-conformance``) binds every call to the signatures read from the wheel and
enforces the protocol's rules. This one lets the package's own tests check the call
order without that wheel.
"""

from __future__ import annotations

import contextlib
import types


class StandIn:
    """Builds the ``torch_npu`` module and its ``npu`` namespace, sharing one call log."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.npu = self._namespace()
        self.module = types.ModuleType("torch_npu")
        self.module.npu = self.npu

    def _namespace(self) -> types.SimpleNamespace:
        log = self.log
        current = {"stream": None}

        class Stream:
            def wait_event(self, event):
                log.append(("wait_event", self, event))

            def wait_stream(self, stream):
                log.append(("wait_stream", self, stream))

            def __repr__(self):
                return f"Stream#{id(self) % 1000}"

        class Event:
            def record(self, stream=None):
                log.append(("event.record", self, stream))

        class ExternalEvent:
            def record(self, stream=None):
                log.append(("external.record", self, stream))

            def wait(self, stream=None):
                log.append(("external.wait", self, stream))

            def reset(self, stream=None):
                log.append(("external.reset", self, stream))

        class NPUGraph:
            def replay(self):
                log.append(("replay", self))

        class graph:
            def __init__(self, npu_graph, pool=None, stream=None, capture_error_mode="global"):
                self.args = (npu_graph, pool, stream, capture_error_mode)

            def __enter__(self):
                log.append(("capture_begin", *self.args))
                current["stream"] = self.args[2]

            def __exit__(self, *exc):
                log.append(("capture_end", self.args[0]))
                current["stream"] = None

        default = Stream()

        @contextlib.contextmanager
        def stream_context(stream):
            previous = current["stream"]
            current["stream"] = stream
            log.append(("use_stream", stream))
            try:
                yield
            finally:
                current["stream"] = previous

        return types.SimpleNamespace(
            Stream=Stream,
            Event=Event,
            ExternalEvent=ExternalEvent,
            NPUGraph=NPUGraph,
            graph=graph,
            graph_pool_handle=lambda: "pool",
            current_stream=lambda: current["stream"] or default,
            stream=stream_context,
            synchronize=lambda: log.append(("synchronize",)),
            empty_cache=lambda: log.append(("empty_cache",)),
            mem_get_info=lambda: (0, 0),
            is_current_stream_capturing=lambda: False,
            current_device=lambda: 0,
            device=lambda index: contextlib.nullcontext(),
            graph_task_group_begin=lambda s: log.append(("group_begin", s)),
            graph_task_group_end=lambda s: log.append(("group_end", s)) or ("handle", len(log)),
            graph_task_update_begin=lambda s, h: log.append(("update_begin", s, h)),
            graph_task_update_end=lambda s: log.append(("update_end", s)),
        )
