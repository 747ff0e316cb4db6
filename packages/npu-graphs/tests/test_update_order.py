"""Which comes first, a replay or the update of its tasks: ``updates_follow_replay``.

On the npu backend a captured ExternalEvent wait holds each task group until its update
records the event, so ``GraphWrapper.replay_step`` launches the replay first and
updates after it; the host backend (and CUDA, which has no task update) updates first.
The npu backend runs on the call-logging stand-in of ``npu_graphs_npu_stand_in``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from npu_graphs_cases import segment_mix
from npu_graphs_npu_stand_in import StandIn

from npu_graphs import (
    GraphBackend,
    GraphWrapper,
    PerMicroBatch,
    RuntimeMode,
    TaskRegistry,
    TaskUpdateError,
    get_backend,
    graph_dispatch,
)
from npu_graphs.backends.cuda import CudaGraphBackend
from npu_graphs.backends.host import HostGraphBackend

KEY = 4
LAYERS = 2


@pytest.fixture
def npu(monkeypatch):
    """The npu backend on the logging stand-in: ``(backend, log)``."""
    fake = StandIn()
    monkeypatch.setitem(sys.modules, "torch_npu", fake.module)
    monkeypatch.setattr(torch, "npu", fake.npu, raising=False)
    from npu_graphs.backends.npu import NpuGraphBackend

    return NpuGraphBackend(), fake.log


def _engine(backend: GraphBackend, seq_lens=(KEY,)):
    """Two tasks per graph, captured (and, on devices, replayed once) for ``KEY``."""
    registry = TaskRegistry("main", expected_tasks=LAYERS)

    def model(x, step):
        for _ in range(LAYERS):
            x = registry.call(segment_mix, x, step=step)
        return x

    wrapper = GraphWrapper(
        model, backend=backend, tasks=registry, stream=backend.new_stream(), pool=backend.new_pool()
    )
    with graph_dispatch(RuntimeMode.FULL, KEY):
        wrapper(torch.ones(KEY, 2), {"seq_lens": seq_lens})
    return wrapper, registry


def _names(log) -> list[str]:
    return [entry[0] for entry in log]


def test_only_the_npu_backend_updates_after_the_replay() -> None:
    assert GraphBackend.updates_follow_replay is False
    assert HostGraphBackend.updates_follow_replay is False
    assert CudaGraphBackend.updates_follow_replay is False
    from npu_graphs.backends.npu import NpuGraphBackend

    assert NpuGraphBackend.updates_follow_replay is True


def test_npu_replay_is_launched_before_its_update(npu) -> None:
    backend, log = npu
    wrapper, _ = _engine(backend)
    capture_replay_done = [e for e in log if e[0] == "event.record"][-1][1]
    log.clear()
    wrapper.replay_step(KEY, {"seq_lens": [1, 3]})
    per_task = ["update_begin", "update_end", "external.record"]
    assert _names(log) == ["replay", "event.record", "wait_event", "use_stream", *per_task * 2]
    launched_done = log[1][1]
    waited = log[2][2]
    # The update waits for the replay before the launched one: waiting for the launched
    # one would deadlock (it waits for this update).
    assert waited is capture_replay_done and waited is not launched_done
    update_stream = log[2][1]
    assert all(e[1] is update_stream for e in log if e[0] in ("update_begin", "update_end"))
    assert all(e[2] is update_stream for e in log if e[0] == "external.record")
    assert wrapper.entry(KEY).replays == 2
    assert "synchronize" not in _names(log)


def test_npu_tasks_are_released_when_the_update_fails(npu) -> None:
    backend, log = npu
    wrapper, _ = _engine(backend)
    log.clear()
    with pytest.raises(TaskUpdateError):
        # Steps per micro-batch for tasks recorded outside micro-batches.
        wrapper.replay_step(KEY, PerMicroBatch([{"seq_lens": [KEY]}]))
    assert _names(log)[0] == "replay"
    assert _names(log).count("external.record") == 2  # the launched replay never hangs
    log.clear()
    wrapper.replay_step(KEY, {"seq_lens": [4]})  # the next step, in the usual order
    assert _names(log)[:3] == ["replay", "event.record", "wait_event"]


def test_a_key_without_tasks_just_replays(npu) -> None:
    backend, log = npu
    wrapper = GraphWrapper(
        lambda x: x * 2, backend=backend, tasks=TaskRegistry("none"), pool=backend.new_pool()
    )
    with graph_dispatch(RuntimeMode.FULL, KEY):
        wrapper(torch.ones(KEY, 2))
    log.clear()
    wrapper.replay_step(KEY, object())  # the step is not read
    assert "update_begin" not in _names(log) and _names(log)[0] == "replay"


def test_npu_tasks_with_fixed_buffers_update_before_the_replay(npu, monkeypatch) -> None:
    backend, _ = npu
    # CPU tensors count as the device's here: seq_lens becomes a fixed buffer.
    monkeypatch.setattr(type(backend), "device_type", "cpu")
    wrapper, registry = _engine(backend, seq_lens=torch.tensor([KEY]))
    assert registry.has_fixed_buffers(KEY)
    seen = _replays_at_update(monkeypatch, wrapper, registry)
    wrapper.replay_step(KEY, {"seq_lens": torch.tensor([KEY])})
    assert seen == [1] and wrapper.entry(KEY).replays == 2  # the copy precedes the launch


def test_host_updates_before_the_replay(monkeypatch) -> None:
    backend = get_backend("host")
    assert not backend.updates_follow_replay
    wrapper, registry = _engine(backend)
    seen = _replays_at_update(monkeypatch, wrapper, registry)
    x = torch.ones(KEY, 2)
    out = wrapper.replay_step(KEY, {"seq_lens": [1, 3]}, x, None)
    assert seen == [0] and wrapper.entry(KEY).replays == 1
    expected = segment_mix(segment_mix(x, seq_lens=[1, 3]), seq_lens=[1, 3])
    torch.testing.assert_close(out, expected)


def test_replay_step_of_an_unknown_key_is_refused() -> None:
    wrapper, _ = _engine(get_backend("host"))
    with pytest.raises(KeyError, match="no graph captured"):
        wrapper.replay_step(KEY + 1, {"seq_lens": [KEY]})


def _replays_at_update(monkeypatch, wrapper, registry) -> list[int]:
    """The replays of ``KEY`` counted at each update of ``registry`` (filled as they come)."""
    seen: list[int] = []
    update = registry.update

    def counting_update(key, step):
        seen.append(wrapper.entry(KEY).replays)
        update(key, step)

    monkeypatch.setattr(registry, "update", counting_update)
    return seen
