"""FullGraphManager: mode choice per step, graph outputs equal eager, eager fallback."""

from __future__ import annotations

import pytest
import torch
from npu_graphs_cases import ToyModel, make_step, segment_mix, split_tokens

from npu_graphs import (
    BatchDescriptor,
    FullGraphManager,
    GraphWrapper,
    RuntimeMode,
    TaskRegistry,
    plan_capture,
)

HIDDEN, MAX_REQS, LAYERS = 16, 4, 2
TOL = dict(rtol=1e-5, atol=1e-5)
FULL, PIECEWISE, NONE = RuntimeMode.FULL, RuntimeMode.PIECEWISE, RuntimeMode.NONE


class Engine:
    """Static input buffer + step; forward reads both, as a model runner's forward does."""

    def __init__(self, backend, device, plan, **manager_kwargs):
        self.backend, self.device = backend, device
        self.registry = TaskRegistry("main", expected_tasks=LAYERS)
        self.model = ToyModel(HIDDEN, LAYERS, device, torch.float32, self.registry)
        self.oracle = ToyModel(HIDDEN, LAYERS, device, torch.float32)
        self.x = torch.zeros(64, HIDDEN, device=device)
        self.step = None
        # made outside any capture: device step tensors given at capture become fixed buffers
        self.capture_steps = {n: make_step(backend, [n], MAX_REQS, device) for n in range(1, 65)}
        self.forward_calls = 0
        self.manager = FullGraphManager(
            self.forward,
            plan,
            backend=backend,
            tasks=self.registry,
            progress=False,
            **manager_kwargs,
        )

    def forward(self, batch: BatchDescriptor):
        self.forward_calls += 1
        step = self.step or self.capture_steps[batch.num_tokens]
        return self.model(self.x[: batch.num_tokens], step)

    def run(self, x, seq_lens, uniform_decode=False):
        n = x.shape[0]
        self.x[:n].copy_(x)
        self.step = make_step(self.backend, seq_lens, MAX_REQS, self.device)
        return self.manager.run(n, uniform_decode, step=self.step).clone()


def test_mode_choice(backend, device):
    plan = plan_capture([1, 2, 4, 8], num_speculative_tokens=1, max_num_reqs=4)
    engine = Engine(backend, device, plan)
    manager = engine.manager
    assert manager.dispatch(3, uniform_decode=True).mode is NONE  # nothing captured yet
    reports = manager.capture()
    assert [len(r.keys) for r in reports] == [4, 3]
    assert reports[0].keys[0] == BatchDescriptor(8, False)  # largest first
    assert reports[1].keys == (
        BatchDescriptor(8, True),
        BatchDescriptor(4, True),
        BatchDescriptor(2, True),
    )
    decode = manager.dispatch(3, uniform_decode=True)
    assert (decode.mode, decode.batch, decode.num_tokens) == (FULL, BatchDescriptor(4, True), 3)
    assert manager.dispatch(3).batch == BatchDescriptor(4, False)
    assert manager.dispatch(1, uniform_decode=True).batch == BatchDescriptor(2, True)
    too_big = manager.dispatch(9, uniform_decode=True)
    assert (too_big.mode, too_big.batch) == (NONE, BatchDescriptor(9, True))


def test_uniform_decode_mode_none_falls_back_to_mixed(backend, device):
    plan = plan_capture([1, 2, 4, 8], max_num_reqs=4)
    engine = Engine(backend, device, plan, uniform_decode_mode=NONE)
    engine.manager.capture()
    chosen = engine.manager.dispatch(3, uniform_decode=True)
    assert (chosen.mode, chosen.batch) == (FULL, BatchDescriptor(4, False))
    assert engine.manager.dispatch(3, uniform_decode=False).mode is FULL


def test_steps_through_graphs_equal_eager(backend, device):
    plan = plan_capture([2, 4, 8, 16], max_num_reqs=MAX_REQS)
    engine = Engine(backend, device, plan)
    engine.manager.capture()
    generator = torch.Generator().manual_seed(0)
    steps = [(5, [2, 4]), (16, [3, 9, 12]), (3, [1, 2]), (40, [7, 30]), (5, [4]), (4, [1, 2, 3])]
    for num_tokens, cuts in steps:
        seq_lens = split_tokens(num_tokens, cuts)
        uniform = len(set(seq_lens)) == 1 and num_tokens <= MAX_REQS
        x = torch.randn(num_tokens, HIDDEN, generator=generator).to(device)
        calls = engine.forward_calls
        out = engine.run(x, seq_lens, uniform_decode=uniform)
        assert out.shape == (num_tokens, HIDDEN)
        torch.testing.assert_close(out, engine.oracle(x, {"seq_lens": seq_lens}), **TOL)
        graphed = engine.manager.dispatch(num_tokens, uniform).mode is FULL
        assert (engine.forward_calls == calls) == graphed  # replay, or eager for 40 tokens


def test_uncaptured_sizes_run_eagerly(backend, device):
    plan = plan_capture([4, 8])
    engine = Engine(backend, device, plan)
    x = torch.randn(3, HIDDEN).to(device)
    out = engine.run(x, [3])  # capture() never ran: eager, no crash
    torch.testing.assert_close(out, engine.oracle(x, {"seq_lens": [3]}), **TOL)
    assert engine.manager.captured_keys() == []


def test_piecewise_mixed_mode_captures_inner_pieces(backend, device):
    weights = ToyModel(HIDDEN, LAYERS, device, torch.float32).weights
    pieces = [
        GraphWrapper(
            lambda x, w=w: torch.tanh(x @ w),
            backend=backend,
            mode=PIECEWISE,
            debug_check_addresses=True,
        )
        for w in weights
    ]
    x_buf = torch.zeros(16, HIDDEN, device=device)
    residual = torch.zeros(16, HIDDEN, device=device)  # static input of the later pieces
    current = {"seq_lens": None}

    def forward(batch):
        n = batch.num_tokens
        seq_lens = current["seq_lens"] or [n]
        residual[:n].copy_(x_buf[:n])
        for piece in pieces:
            mixed = segment_mix(piece(residual[:n]), seq_lens=seq_lens)  # attention stays eager
            residual[:n].add_(mixed)
        return residual[:n]

    manager = FullGraphManager(
        forward,
        plan_capture([4, 8]),
        backend=backend,
        mixed_mode=PIECEWISE,
        uniform_decode_mode=NONE,
        progress=False,
    )
    manager.capture()
    assert all(p.keys() == [BatchDescriptor(8), BatchDescriptor(4)] for p in pieces)
    x = torch.randn(6, HIDDEN).to(device)
    x_buf[:6].copy_(x)
    x_buf[6:8].zero_()
    current["seq_lens"] = [2, 4]
    assert manager.dispatch(6).mode is PIECEWISE
    out = manager.run(6)
    expected = ToyModel(HIDDEN, LAYERS, device, torch.float32)(x, {"seq_lens": [2, 4]})
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"forward": 3}, TypeError, "forward must be callable"),
        ({"plan": [1, 2]}, TypeError, "plan must be a CapturePlan"),
        ({"mixed_mode": "full"}, TypeError, "mixed_mode must be a RuntimeMode"),
        ({"uniform_decode_mode": PIECEWISE}, ValueError, "uniform_decode_mode must be FULL"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    arguments = {"forward": lambda b: None, "plan": plan_capture([1]), "backend": "host"}
    arguments.update(kwargs)
    forward, plan = arguments.pop("forward"), arguments.pop("plan")
    with pytest.raises(error, match=match):
        FullGraphManager(forward, plan, **arguments)


def test_bad_token_count():
    manager = FullGraphManager(lambda b: None, plan_capture([1]), backend="host")
    with pytest.raises(ValueError, match="num_tokens must be an int >= 1, got 0"):
        manager.dispatch(0)
