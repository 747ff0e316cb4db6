"""GraphWrapper + TaskRegistry: graph replay equals eager execution, updates matter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from npu_graphs_cases import ToyModel, make_step, segment_mix, split_tokens

import npu_graphs
import npu_graphs.session
from npu_graphs import GraphWrapper, RuntimeMode, TaskRegistry, graph_dispatch

SIZES = (1, 2, 4, 8, 16)
MAX_REQS = 4
HIDDEN = 16
TOL = dict(rtol=1e-5, atol=1e-5)


def _padded(num_tokens: int) -> int:
    return next(s for s in SIZES if s >= num_tokens)


class Engine:
    """A FULL-graph step loop: static input buffer, update before replay, eager oracle."""

    def __init__(self, backend, device, layers=3):
        self.backend, self.device = backend, device
        self.registry = TaskRegistry("main", expected_tasks=layers)
        self.model = ToyModel(HIDDEN, layers, device, torch.float32, self.registry)
        self.eager = ToyModel(HIDDEN, layers, device, torch.float32)
        self.wrapper = GraphWrapper(
            self.model, backend=backend, mode=RuntimeMode.FULL, tasks=self.registry
        )
        self.x = torch.zeros(max(SIZES), HIDDEN, device=device)

    def step(self, x, seq_lens, update=True):
        n = x.shape[0]
        size = _padded(n)
        self.x[:n].copy_(x)
        step = make_step(self.backend, seq_lens, MAX_REQS, self.device)
        if update and self.wrapper.has_graph(size):
            self.registry.update(size, step)
        with graph_dispatch(RuntimeMode.FULL, size):
            return self.wrapper(self.x[:size], step)[:n].clone()

    def reference(self, x, seq_lens):
        return self.eager(x, {"seq_lens": list(seq_lens)})


steps = st.lists(
    st.tuples(st.integers(1, max(SIZES)), st.lists(st.integers(1, 15), max_size=MAX_REQS - 1)),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=steps, seed=st.integers(0, 2**16))
def test_graph_equals_eager_over_random_steps(backend, device, steps, seed):
    engine = Engine(backend, device)
    generator = torch.Generator().manual_seed(seed)
    for num_tokens, cuts in steps:
        seq_lens = split_tokens(num_tokens, cuts)
        x = torch.randn(num_tokens, HIDDEN, generator=generator).to(device)
        torch.testing.assert_close(engine.step(x, seq_lens), engine.reference(x, seq_lens), **TOL)


def test_skipping_update_replays_stale_step_state(backend, device):
    engine = Engine(backend, device)
    x = torch.randn(8, HIDDEN).to(device)
    first, second = [3, 5], [1, 2, 5]
    torch.testing.assert_close(engine.step(x, first), engine.reference(x, first), **TOL)
    stale = engine.step(x, second, update=False)
    torch.testing.assert_close(stale, engine.reference(x, first), **TOL)
    assert not torch.allclose(stale, engine.reference(x, second), **TOL)
    torch.testing.assert_close(engine.step(x, second), engine.reference(x, second), **TOL)


def test_every_update_reissues_and_a_replay_runs_the_last(backend, device):
    engine = Engine(backend, device)
    x = torch.randn(4, HIDDEN).to(device)
    engine.step(x, [4])
    step = make_step(backend, [4], MAX_REQS, device)
    engine.registry.update(4, step)
    engine.registry.update(4, step)
    engine.registry.update(4, make_step(backend, [1, 3], MAX_REQS, device))
    engine.registry.update(4, step)
    torch.testing.assert_close(engine.step(x, [4], update=False), engine.reference(x, [4]), **TOL)


def test_baked_values_compare_by_value_inside_nested_values():
    from npu_graphs.tasks import baked_copy, same_value

    step = {
        "seq_lens": [3, 1],
        "block_table": [[1, 2], [3, 4]],
        "flag": True,
        "lens": torch.tensor([3, 1]),
    }
    same = {
        "seq_lens": [3, 1],
        "block_table": [[1, 2], [3, 4]],
        "flag": True,
        "lens": torch.tensor([3, 1]),
    }
    baked = {name: baked_copy(value) for name, value in step.items()}
    assert all(same_value(baked[name], value) for name, value in same.items())
    for name, value in [
        ("seq_lens", [3, 2]),
        ("block_table", [[1, 2], [3, 5]]),
        ("flag", False),
        ("lens", torch.tensor([3, 2])),
    ]:
        assert not same_value(baked[name], value), name
    step["block_table"][1][1] = 9  # mutated in place after the capture
    assert not same_value(baked["block_table"], step["block_table"])


def test_piecewise_wrappers_inside_full_capture_run_eagerly(backend, device):
    registry = TaskRegistry("main")
    weights = ToyModel(HIDDEN, 2, device, torch.float32).weights
    pieces = [
        GraphWrapper(
            lambda x, w=w: torch.tanh(x @ w),
            backend=backend,
            mode=RuntimeMode.PIECEWISE,
            name=f"piece{i}",
            debug_check_addresses=True,
        )
        for i, w in enumerate(weights)
    ]
    residual = torch.zeros(8, HIDDEN, device=device)  # static input of every piece

    def model(x, step):
        residual.copy_(x)
        for piece in pieces:
            residual.add_(registry.call(segment_mix, piece(residual), step=step))
        return residual

    full = GraphWrapper(model, backend=backend, mode=RuntimeMode.FULL, tasks=registry)
    x = torch.randn(8, HIDDEN).to(device)
    step = make_step(backend, [3, 5], MAX_REQS, device)
    expected = ToyModel(HIDDEN, 2, device, torch.float32)(x, {"seq_lens": [3, 5]})
    with graph_dispatch(RuntimeMode.FULL, 8):
        torch.testing.assert_close(full(x, step).clone(), expected, **TOL)
    assert full.has_graph(8)
    assert not any(p.has_graph(8) for p in pieces)  # recorded inside the FULL graph
    assert registry.num_tasks(8) == 2
    with graph_dispatch(RuntimeMode.PIECEWISE, 8):  # pieces capture, attention stays eager
        torch.testing.assert_close(full(x, step).clone(), expected, **TOL)
        torch.testing.assert_close(full(x, step).clone(), expected, **TOL)
    assert all(p.has_graph(8) for p in pieces)
    assert full.keys() == [8]


def test_failed_capture_leaves_nothing_registered(backend, device):
    registry = TaskRegistry("main")
    fail = {"on": True}

    def model(x, step):
        y = registry.call(segment_mix, x, step=step)
        if fail["on"]:
            raise RuntimeError("boom in layer 1")
        return y

    wrapper = GraphWrapper(model, backend=backend, mode=RuntimeMode.FULL, tasks=registry)
    x = torch.randn(4, HIDDEN).to(device)
    step = make_step(backend, [4], MAX_REQS, device)
    with graph_dispatch(RuntimeMode.FULL, 4), pytest.raises(npu_graphs.GraphCaptureError) as info:
        wrapper(x, step)
    message = str(info.value)
    assert "key 4" in message and "FULL" in message and "boom in layer 1" in message
    assert not wrapper.has_graph(4) and wrapper.keys() == []
    assert 4 not in registry and registry.num_tasks(4) == 0
    assert not backend.is_capturing()
    assert npu_graphs.session.active_session() is None
    fail["on"] = False
    with graph_dispatch(RuntimeMode.FULL, 4):
        torch.testing.assert_close(wrapper(x, step).clone(), segment_mix(x, seq_lens=[4]), **TOL)
    assert registry.num_tasks(4) == 1


def test_expected_task_count_is_enforced(backend, device):
    registry = TaskRegistry("main", expected_tasks=3)
    model = ToyModel(HIDDEN, 2, device, torch.float32, registry)
    wrapper = GraphWrapper(model, backend=backend, tasks=registry)
    step = make_step(backend, [4], MAX_REQS, device)
    with (
        graph_dispatch(RuntimeMode.FULL, 4),
        pytest.raises(npu_graphs.GraphCaptureError, match="recorded 2 tasks, expected 3"),
    ):
        wrapper(torch.randn(4, HIDDEN).to(device), step)
    assert registry.keys() == [] and not wrapper.has_graph(4)


def test_debug_address_check_rejects_moved_inputs(backend, device):
    wrapper = GraphWrapper(lambda x: x * 2, backend=backend, debug_check_addresses=True)
    static = torch.randn(4, HIDDEN).to(device)
    with graph_dispatch(RuntimeMode.FULL, 4):
        wrapper(static)
        torch.testing.assert_close(wrapper(static).clone(), static * 2)
        with pytest.raises(ValueError, match="same static buffers"):
            wrapper(static.clone())


def test_eager_when_mode_is_none_or_not_own(backend, device):
    calls = []
    wrapper = GraphWrapper(
        lambda x: calls.append(1) or x + 1, backend=backend, mode=RuntimeMode.PIECEWISE
    )
    x = torch.zeros(2).to(device)
    wrapper(x)
    with graph_dispatch(RuntimeMode.FULL, 2):
        wrapper(x)
    assert len(calls) == 2 and wrapper.keys() == []


def test_output_addresses_follow_the_backends_contract(backend, device):
    """Device graphs refresh the captured outputs in place; host graphs return each
    replay's own tensors and keep none between replays."""
    wrapper = GraphWrapper(lambda x: x @ x.T, backend=backend)
    x = torch.randn(4, 4).to(device)
    with graph_dispatch(RuntimeMode.FULL, 4):
        first = wrapper(x)
        torch.testing.assert_close(first, x @ x.T)
        x.mul_(2)
        second = wrapper(x)
    torch.testing.assert_close(second, x @ x.T)
    if backend.replay_returns_outputs:
        assert wrapper.entry(4).outputs is None
        torch.testing.assert_close(first, x @ x.T / 4)  # not overwritten by the replay
    else:
        assert second.data_ptr() == first.data_ptr()  # fixed output address
    if backend.weak_ref_outputs:
        assert second.untyped_storage().data_ptr() == wrapper.entry(4).outputs.data_ptr()


def test_call_task_routes_to_the_capturing_wrappers_registry(backend, device):
    registry = TaskRegistry("main")
    wrapper = GraphWrapper(
        lambda x, step: npu_graphs.call_task(segment_mix, x, step=step),
        backend=backend,
        tasks=registry,
    )
    x = torch.randn(6, HIDDEN).to(device)
    with graph_dispatch(RuntimeMode.FULL, 6):
        wrapper(x, make_step(backend, [6], MAX_REQS, device))
    registry.update(6, make_step(backend, [2, 4], MAX_REQS, device))
    with graph_dispatch(RuntimeMode.FULL, 6):
        out = wrapper(x, None).clone()
    torch.testing.assert_close(out, segment_mix(x, seq_lens=[2, 4]), **TOL)
    # outside a capture call_task simply runs
    torch.testing.assert_close(
        npu_graphs.call_task(segment_mix, x, step={"seq_lens": [6]}), segment_mix(x, seq_lens=[6])
    )


def test_independent_registries_update_independently(backend, device):
    main, draft = TaskRegistry("main"), TaskRegistry("draft")
    main_model = GraphWrapper(ToyModel(HIDDEN, 2, device, torch.float32, main), backend=backend)
    draft_model = GraphWrapper(
        ToyModel(HIDDEN, 1, device, torch.float32, draft, seed=1), backend=backend
    )
    x = torch.randn(8, HIDDEN).to(device)
    # each model owns its step state (on CUDA: its own fixed buffers)
    with graph_dispatch(RuntimeMode.FULL, 8):
        main_model(x, make_step(backend, [8], MAX_REQS, device))
        draft_model(x, make_step(backend, [8], MAX_REQS, device))
    assert (main.num_tasks(8), draft.num_tasks(8)) == (2, 1)
    main.update(8, make_step(backend, [4, 4], MAX_REQS, device))
    with graph_dispatch(RuntimeMode.FULL, 8):
        main_out, draft_out = main_model(x, None).clone(), draft_model(x, None).clone()
    torch.testing.assert_close(
        main_out, ToyModel(HIDDEN, 2, device, torch.float32)(x, {"seq_lens": [4, 4]}), **TOL
    )
    torch.testing.assert_close(  # the draft graph still has its own (first) step
        draft_out, ToyModel(HIDDEN, 1, device, torch.float32, seed=1)(x, {"seq_lens": [8]}), **TOL
    )
