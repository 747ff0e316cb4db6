"""GraphWrapper + TaskRegistry: graph replay equals eager execution, updates matter."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from npu_graphs_cases import ToyModel, make_step, split_tokens

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


def test_unchanged_step_reissues_nothing(backend, device):
    engine = Engine(backend, device)
    x = torch.randn(4, HIDDEN).to(device)
    engine.step(x, [4])
    step = make_step(backend, [4], MAX_REQS, device)
    assert engine.registry.update(4, step) is (not backend.supports_task_update)
    assert engine.registry.update(4, step) is (not backend.supports_task_update)
    assert engine.registry.update(4, make_step(backend, [1, 3], MAX_REQS, device)) is True
