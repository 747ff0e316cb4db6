"""The npu backend drives torch_npu's task-update protocol in the documented order.

torch_npu cannot run here: a stand-in module logs the calls (names and signatures of
torch_npu 2.14.0), and the tests check their order and arguments.
"""

from __future__ import annotations

import sys

import pytest
import torch
from npu_graphs_cases import segment_mix
from npu_graphs_npu_stand_in import StandIn

from npu_graphs import GraphWrapper, RuntimeMode, TaskRegistry, graph_dispatch


@pytest.fixture
def stand_in(monkeypatch):
    def install():
        fake = StandIn()
        monkeypatch.setitem(sys.modules, "torch_npu", fake.module)
        monkeypatch.setattr(torch, "npu", fake.npu, raising=False)
        return fake

    return install


def _names(entries):
    return [entry[0] for entry in entries]


def _captured_engine(backend, layers=2):
    registry = TaskRegistry("main", expected_tasks=layers)

    def model(x, step):
        for _ in range(layers):
            x = registry.call(segment_mix, x, step=step)
        return x

    wrapper = GraphWrapper(model, backend=backend, tasks=registry)
    with graph_dispatch(RuntimeMode.FULL, 4):
        wrapper(torch.ones(4, 2), {"seq_lens": [4]})
    return wrapper, registry


def test_capture_brackets_each_task_with_an_external_event_and_a_group(stand_in):
    from npu_graphs.backends.npu import NpuGraphBackend

    fake = stand_in()
    backend = NpuGraphBackend()
    _captured_engine(backend)
    start = _names(fake.log).index("capture_begin")
    capture = _names(fake.log)[start : _names(fake.log).index("capture_end") + 1]
    per_task = ["external.wait", "external.reset", "group_begin", "group_end"]
    assert capture == ["capture_begin", *per_task, *per_task, "capture_end"]
    waits = [e for e in fake.log if e[0] == "external.wait"]
    assert all(e[2] is waits[0][2] for e in waits)  # on the capture stream
    # after capture the wrapper replays at once: each task's event is released first
    tail = _names(fake.log)[_names(fake.log).index("capture_end") + 1 :]
    assert tail == ["use_stream", "external.record", "external.record", "replay", "event.record"]
    assert "synchronize" not in tail


def test_update_reissues_on_the_update_stream_after_the_last_replay(stand_in):
    from npu_graphs.backends.npu import NpuGraphBackend

    fake = stand_in()
    backend = NpuGraphBackend()
    wrapper, registry = _captured_engine(backend)
    fake.log.clear()
    registry.update(4, {"seq_lens": [1, 3]})
    log = fake.log
    update_stream = log[0][1]
    assert log[0][0] == "wait_event"  # ordered after the previous replay, no synchronize
    assert (
        _names(log)
        == ["wait_event", "use_stream"] + ["update_begin", "update_end", "external.record"] * 2
    )
    assert all(e[1] is update_stream for e in log if e[0] in ("update_begin", "update_end"))
    assert all(e[2] is update_stream for e in log if e[0] == "external.record")
    assert log[2][2] != log[5][2]  # each task's own group handle
    fake.log.clear()
    with graph_dispatch(RuntimeMode.FULL, 4):
        wrapper(torch.ones(4, 2), None)
    assert _names(fake.log) == ["replay", "event.record"]  # already armed by the update


def test_a_replay_without_update_only_releases_the_events(stand_in):
    from npu_graphs.backends.npu import NpuGraphBackend

    fake = stand_in()
    backend = NpuGraphBackend()
    wrapper, registry = _captured_engine(backend)
    fake.log.clear()
    registry.update(4, {"seq_lens": [4]})
    assert _names(fake.log).count("external.record") == 2
    fake.log.clear()
    with graph_dispatch(RuntimeMode.FULL, 4):
        wrapper(torch.ones(4, 2), None)
        wrapper(torch.ones(4, 2), None)  # no update in between: released, never stuck
    names = _names(fake.log)
    assert names.count("replay") == 2 and names.count("external.record") == 2
    assert "synchronize" not in names


def test_stream_budget_and_cache_flush(stand_in):
    from npu_graphs.backends.npu import NpuGraphBackend

    fake = stand_in()
    backend = NpuGraphBackend(stream_budget=100)
    assert backend.max_graphs(9) == 10
    with backend.suppress_cache_flush():
        torch.npu.empty_cache()
    assert "empty_cache" not in _names(fake.log)
