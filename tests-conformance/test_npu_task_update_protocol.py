"""The documented NPU task-update protocol, on the stand-in runtime, with ascend attention.

The flow of torch_npu's own example (``graph_task_update_begin`` documentation):
capture the attention op inside a task group after ``ExternalEvent.wait + reset``;
per step re-issue it with new host arguments between ``graph_task_update_begin``
and ``graph_task_update_end`` on an update stream, ``record`` the event there,
replay. Here the op is the ascend provider's paged attention, so a stale length
shows up as a wrong output; each broken rule of the protocol must be caught.
"""

from __future__ import annotations

import pytest
import torch
from ascend_cases import DTYPE_TOLERANCE, Case, build_batch, max_error
from torch_npu_schemas import SchemaViolation

from npu_attention import BatchState, plan, register_provider, run
from npu_attention.spec import AttentionSpec

CASE = Case("graph_decode", BatchState.DECODE_ONLY, (0, 100, 300), (1, 1, 1), num_decodes=3)
TOLERANCE = DTYPE_TOLERANCE[CASE.dtype]


class Steps:
    """Two decode steps over one cache: step 2 appends one token to every request."""

    def __init__(self) -> None:
        register_provider("ascend-graph", "ascend_cases:HostAscendProvider")
        self.batch = build_batch(CASE)
        self.spec: AttentionSpec = CASE.spec
        self.key_cache = self.batch.key_cache.clone()
        self.value_cache = self.batch.value_cache.clone()
        self.query = self.batch.query.clone()  # the graph's static input
        self.out = torch.zeros_like(self.query)  # the graph's static output

    def plan(self, step: int, provider: str = "ascend-graph"):
        seq_lens = [n + step - 1 for n in self.batch.seq_lens]
        size = self.spec.block_size
        slots = [
            int(self.batch.block_tables[r, (n - 1) // size]) * size + (n - 1) % size
            for r, n in enumerate(seq_lens)
        ]
        return plan(
            self.batch.cu_seqlens_q,
            seq_lens,
            self.batch.block_tables,
            torch.tensor(slots),
            CASE.num_decodes,
            self.spec,
            provider=provider,
        )

    def write_step(self, step: int, generator_seed: int) -> torch.Tensor:
        """Eagerly write step ``step``'s K/V; return its query."""
        generator = torch.Generator().manual_seed(generator_seed)
        shape = (3, CASE.num_kv_heads, CASE.head_size)
        key = torch.randn(*shape, generator=generator).to(CASE.dtype)
        value = torch.randn(*shape, generator=generator).to(CASE.dtype)
        self.plan(step).provider.write_kv(
            key, value, self.key_cache, self.value_cache, self.plan(step)
        )
        return torch.randn(self.query.shape, generator=generator).to(CASE.dtype)

    def expected(self, step: int) -> torch.Tensor:
        out = torch.zeros_like(self.query)
        run(
            self.query,
            None,
            None,
            self.key_cache,
            self.value_cache,
            self.plan(step, "reference"),
            out,
        )
        return out

    def attend(self, step_plan) -> None:
        step_plan.provider.attend(self.query, self.key_cache, self.value_cache, step_plan, self.out)


def _capture(npu, steps: Steps, *, with_event: bool = True):
    graph, capture_stream, event = npu.NPUGraph(), npu.Stream(), npu.ExternalEvent()
    with npu.graph(graph, stream=capture_stream):
        stream = npu.current_stream()
        if with_event:
            event.wait(stream)
            event.reset(stream)
        npu.graph_task_group_begin(stream)
        steps.attend(steps.plan(1))
        handle = npu.graph_task_group_end(stream)
    return graph, handle, event


def _update(npu, steps: Steps, handle, event, step: int, update_stream) -> None:
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        steps.attend(steps.plan(step))
        npu.graph_task_update_end(update_stream)
        if event is not None:
            event.record(update_stream)


def test_documented_flow_replays_with_updated_lengths(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, handle, event = _capture(npu, steps)
    assert torch.equal(steps.out, torch.zeros_like(steps.out)), "capture ran the op"

    graph.replay()
    assert max_error(steps.out, steps.expected(1)) < TOLERANCE

    steps.query.copy_(steps.write_step(2, generator_seed=1))
    graph.replay()  # no update: the captured lengths are stale now
    assert max_error(steps.out, steps.expected(2)) > 10 * TOLERANCE

    _update(npu, steps, handle, event, step=2, update_stream=npu.Stream())
    graph.replay()
    assert max_error(steps.out, steps.expected(2)) < TOLERANCE
    assert "torch.npu.synchronize" not in stand_in.log.names()


def test_update_on_the_capture_stream_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    _graph, handle, event = _capture(npu, steps)
    with pytest.raises(SchemaViolation, match="update stream must differ from the capture"):
        _update(npu, steps, handle, event, step=2, update_stream=handle.graph.capture_stream)


def test_replay_before_the_event_is_recorded_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, handle, _ = _capture(npu, steps)
    _update(npu, steps, handle, None, step=2, update_stream=npu.Stream())
    with pytest.raises(SchemaViolation, match="ExternalEvent was not recorded"):
        graph.replay()


def test_update_without_an_external_event_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    graph, handle, event = _capture(npu, steps, with_event=False)
    _update(npu, steps, handle, event, step=2, update_stream=npu.Stream())
    with pytest.raises(SchemaViolation, match="no ExternalEvent orders the replay"):
        graph.replay()


def test_update_with_other_ops_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    _graph, handle, _event = _capture(npu, steps)
    update_stream = npu.Stream()
    with npu.stream(update_stream), pytest.raises(SchemaViolation, match="re-issue the ops"):
        npu.graph_task_update_begin(update_stream, handle)
        step = steps.plan(2)
        step.provider.write_kv(
            steps.query[:, :2], steps.query[:, :2], steps.key_cache, steps.value_cache, step
        )
        npu.graph_task_update_end(update_stream)


def test_update_issued_off_the_update_stream_is_caught(stand_in) -> None:
    npu, steps = stand_in.npu, Steps()
    _graph, handle, _event = _capture(npu, steps)
    update_stream = npu.Stream()
    npu.graph_task_update_begin(update_stream, handle)
    with pytest.raises(SchemaViolation, match="not the update stream"):
        steps.attend(steps.plan(2))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda npu: npu.graph_task_group_start(npu.current_stream()),
            "no attribute 'graph_task_group_start'",
        ),
        (
            lambda npu: npu.graph_task_update_begin(npu.Stream(), None, task=None),
            "unexpected keyword argument 'task'",
        ),
        (lambda npu: npu.graph_task_group_end(), "missing a required argument: 'stream'"),
        (
            lambda npu: npu.ExternalEvent().record(npu.Stream(), npu.Stream()),
            "too many positional arguments",
        ),
        (
            lambda npu: npu.graph_task_group_begin(npu.current_stream()),
            "graph_task_group_begin outside a capture",
        ),
        (lambda npu: npu.NPUGraph().capture_begin(), "capture on the default stream"),
    ],
)
def test_wrong_runtime_calls_are_caught(stand_in, call, message) -> None:
    with pytest.raises(SchemaViolation, match=message):
        call(stand_in.npu)


def test_synchronize_during_capture_is_caught(stand_in) -> None:
    npu = stand_in.npu
    with (
        pytest.raises(SchemaViolation, match="synchronize during a capture"),
        npu.graph(npu.NPUGraph(), stream=npu.Stream()),
    ):
        npu.synchronize()
