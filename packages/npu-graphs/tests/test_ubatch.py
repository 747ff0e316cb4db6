"""MicroBatchRunner: split runs equal the unsplit batch, eagerly and as a captured graph."""

from __future__ import annotations

import pytest
import torch
from npu_graphs_cases import segment_mix

from npu_graphs import (
    MicroBatchRunner,
    PerMicroBatch,
    RuntimeMode,
    TaskRegistry,
    TaskUpdateError,
    graph_dispatch,
    micro_batch_scope,
)

HIDDEN = 16
TOL = dict(rtol=1e-5, atol=1e-5)


def make_layers(device, count=3):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(HIDDEN, HIDDEN, generator=generator) / 4).to(device) for _ in range(count)]


def overlapped_model(layers, trace=None):
    """Per layer: compute, then a 'collective' on the comm stream, handing the turn over."""

    def run(x, ctx):
        for i, weight in enumerate(layers):
            x = torch.tanh(x @ weight)
            if trace is not None:
                trace.append((ctx.index, i))
            with ctx.communicate():
                x = x * 0.5 + 1.0  # stands for an all-reduce
            ctx.yield_turn()
        return x

    return run


def unsplit(layers, x):
    for weight in layers:
        x = torch.tanh(x @ weight) * 0.5 + 1.0
    return x


def test_split_equals_unsplit_and_threads_take_turns(backend, device):
    layers = make_layers(device)
    trace = []
    runner = MicroBatchRunner(overlapped_model(layers, trace), backend=backend)
    x = torch.randn(10, HIDDEN).to(device)
    torch.testing.assert_close(runner(x, [4, 6]), unsplit(layers, x), **TOL)
    assert trace == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def test_no_split_runs_one_batch(backend, device):
    layers = make_layers(device)
    trace = []
    runner = MicroBatchRunner(overlapped_model(layers, trace), backend=backend)
    x = torch.randn(5, HIDDEN).to(device)
    torch.testing.assert_close(runner(x), unsplit(layers, x), **TOL)
    torch.testing.assert_close(runner(x, [5]), unsplit(layers, x), **TOL)
    assert {index for index, _ in trace} == {0}


def test_overlap_is_captured_once_per_split_and_replayed(backend, device):
    layers = make_layers(device)
    trace = []
    runner = MicroBatchRunner(overlapped_model(layers, trace), backend=backend)
    static = torch.zeros(12, HIDDEN, device=device)
    for seed in range(3):
        x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(device)
        static.copy_(x)
        with graph_dispatch(RuntimeMode.FULL, 12):
            out = runner(static, [5, 7]).clone()
        torch.testing.assert_close(out, unsplit(layers, x), **TOL)
    assert runner.has_graph(12, [5, 7])
    assert len(trace) == 6 * (1 + backend.warmup_runs)  # Python ran at capture only


def test_tasks_inside_micro_batches_are_updatable(backend, device):
    if not backend.supports_task_update:
        pytest.skip("host-list step arguments need task update")
    registry = TaskRegistry("main")
    step = {"seq_lens": [3, 3]}

    def run(x, ctx):
        return registry.call(segment_mix, x, step=step)

    runner = MicroBatchRunner(run, backend=backend, tasks=registry)
    static = torch.randn(12, HIDDEN).to(device)
    with graph_dispatch(RuntimeMode.FULL, 12):
        runner(static, [6, 6])
    key = (12, (6, 6))
    assert registry.num_tasks(key) == 2
    registry.update(key, {"seq_lens": [1, 5]})
    with graph_dispatch(RuntimeMode.FULL, 12):
        out = runner(static, [6, 6]).clone()
    expected = torch.cat([segment_mix(part, seq_lens=[1, 5]) for part in static.split(6)])
    torch.testing.assert_close(out, expected, **TOL)


def _per_micro_batch_model(registry, captured_steps):
    """Two task layers per micro-batch, a hand-over between them; each micro-batch's
    tasks capture its own step (``captured_steps[index]``)."""

    def run(x, ctx):
        step = captured_steps[ctx.index]
        x = registry.call(segment_mix, torch.tanh(x), step=step["layer.0"], name="layer.0")
        ctx.yield_turn()
        return registry.call(segment_mix, x * 0.5, step=step["layer.1"], name="layer.1")

    return run


def _per_micro_batch_expected(static, splits, seq_lens):
    parts = []
    for part, lens in zip(static.split(list(splits)), seq_lens):
        x = segment_mix(torch.tanh(part), seq_lens=lens)
        parts.append(segment_mix(x * 0.5, seq_lens=lens))
    return torch.cat(parts)


def _named(seq_lens):
    return {name: {"seq_lens": seq_lens} for name in ("layer.0", "layer.1")}


def test_each_micro_batch_takes_its_own_step(backend, device):
    """Unequal halves, each with its own requests: one graph, two micro-batches' tasks,
    each updated with its micro-batch's step before every replay."""
    if not backend.supports_task_update:
        pytest.skip("host-list step arguments need task update")
    registry = TaskRegistry("main", expected_tasks=4)
    splits = (5, 7)
    captured = [_named([2, 3]), _named([4, 3])]
    runner = MicroBatchRunner(_per_micro_batch_model(registry, captured), backend=backend,
                              tasks=registry)  # fmt: skip
    static = torch.randn(12, HIDDEN).to(device)
    with graph_dispatch(RuntimeMode.FULL, 12):
        first = runner(static, splits).clone()
    torch.testing.assert_close(first, _per_micro_batch_expected(static, splits, [[2, 3], [4, 3]]),
                               **TOL)  # fmt: skip
    tasks = registry.tasks(runner.graph_key(12, splits))
    assert sorted(t.micro_batch for t in tasks) == [0, 0, 1, 1]
    for seq_lens in ([[1, 4], [7]], [[5], [1, 1, 5]], [[2, 1, 2], [3, 4]]):
        out = runner.replay_step(12, splits, static, [_named(lens) for lens in seq_lens]).clone()
        torch.testing.assert_close(out, _per_micro_batch_expected(static, splits, seq_lens), **TOL)


def test_a_micro_batch_left_with_its_old_step_is_caught(backend, device):
    """The control: hand micro-batch 1 the step it was captured with, and its rows stay
    stale while micro-batch 0's follow the new step."""
    if not backend.supports_task_update:
        pytest.skip("host-list step arguments need task update")
    registry = TaskRegistry("main")
    splits = (6, 6)
    captured = [_named([3, 3]), _named([3, 3])]
    runner = MicroBatchRunner(_per_micro_batch_model(registry, captured), backend=backend,
                              tasks=registry)  # fmt: skip
    static = torch.randn(12, HIDDEN).to(device)
    with graph_dispatch(RuntimeMode.FULL, 12):
        runner(static, splits)
    new = [[1, 5], [5, 1]]
    out = runner.replay_step(12, splits, static, [_named(new[0]), _named([3, 3])]).clone()
    expected = _per_micro_batch_expected(static, splits, new)
    torch.testing.assert_close(out[:6], expected[:6], **TOL)
    assert (out[6:] - expected[6:]).abs().max() > 1e-2


def test_micro_batch_steps_must_fit(backend, device):
    if not backend.supports_task_update:
        pytest.skip("host-list step arguments need task update")
    registry = TaskRegistry("main")
    runner = MicroBatchRunner(
        _per_micro_batch_model(registry, [_named([3]), _named([3])]), backend=backend,
        tasks=registry,
    )  # fmt: skip
    static = torch.randn(6, HIDDEN).to(device)
    with graph_dispatch(RuntimeMode.FULL, 6):
        runner(static, [3, 3])
    with pytest.raises(ValueError, match=r"2 micro-batches \[3, 3\] need one step each, got 1"):
        runner.replay_step(6, [3, 3], static, [_named([3])])
    with pytest.raises(ValueError, match=r"need one step each, got 3"):
        runner.replay_step(6, [3, 3], static, [_named([3])] * 3)
    with pytest.raises(
        TaskUpdateError, match="recorded in micro-batch 1; the update brought steps for 1"
    ):
        registry.update(runner.graph_key(6, (3, 3)), PerMicroBatch([_named([3])]))
    with pytest.raises(ValueError, match="no task registry"):
        MicroBatchRunner(lambda x, ctx: x, backend=backend).replay_step(6, [3, 3], static, [{}, {}])


def test_tasks_outside_micro_batches_refuse_per_micro_batch_steps():
    registry = TaskRegistry("main")
    from npu_graphs import GraphWrapper

    graph = GraphWrapper(
        lambda x: registry.call(segment_mix, x, step={"seq_lens": [2]}), backend="host",
        tasks=registry,
    )  # fmt: skip
    with graph_dispatch(RuntimeMode.FULL, 2):
        graph(torch.randn(2, HIDDEN))
    with pytest.raises(TaskUpdateError, match="recorded outside micro-batches"):
        registry.update(2, PerMicroBatch([{"seq_lens": [2]}]))
    with pytest.raises(ValueError, match="int >= 0"), micro_batch_scope(-1):
        pass


def test_tuple_inputs_and_outputs(backend, device):
    runner = MicroBatchRunner(lambda xs, ctx: (xs[0] + xs[1], xs[0] * 2), backend=backend)
    a, b = torch.randn(6, 3).to(device), torch.randn(6, 3).to(device)
    total, double = runner((a, b), [2, 4])
    torch.testing.assert_close(total, a + b)
    torch.testing.assert_close(double, a * 2)


def test_yield_turn_says_whether_the_turn_passed(backend, device):
    passed = []

    def run(x, ctx):
        for _ in range(1 + ctx.index):
            passed.append((ctx.index, ctx.yield_turn()))
        return x

    MicroBatchRunner(run, backend=backend)(torch.zeros(4, 2).to(device), [2, 2])
    # 0 hands over to 1, 1 back to 0, which ends; 1 is then the last one left.
    assert passed == [(0, True), (1, True), (1, False)]


def test_errors_in_a_micro_batch_reach_the_caller(backend, device):
    def run(x, ctx):
        if ctx.index == 1:
            raise RuntimeError("micro-batch 1 failed")
        ctx.yield_turn()
        return x

    runner = MicroBatchRunner(run, backend=backend)
    with pytest.raises(RuntimeError, match="micro-batch 1 failed"):
        runner(torch.zeros(4, 2).to(device), [2, 2])


@pytest.mark.parametrize(
    ("splits", "match"),
    [([2, 3], "add up to 5, the batch has 6"), ([6, 0], "ints >= 1"), ([7], "do not add up")],
)
def test_bad_splits(splits, match):
    runner = MicroBatchRunner(lambda x, ctx: x, backend="host")
    with pytest.raises(ValueError, match=match):
        runner(torch.zeros(6, 2), splits)


def test_bad_runnable_and_inputs():
    with pytest.raises(TypeError, match="runnable must be callable"):
        MicroBatchRunner(None, backend="host")
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        MicroBatchRunner(lambda x, ctx: x, backend="host")([1, 2], [1, 1])
