"""The bridge's collective custom ops under Dynamo and fake tensors.

vLLM compiles the model at its defaults (torch.compile on); on the CPU Dynamo traces
what it reaches with fake tensors, so every collective op host graphs record must have
a fake implementation that needs no process group, and a compiled call must run the
same collective as an eager one. References: make_fx's fake tracing (the op in the
graph, outputs of the input's shapes), and the eager ops over two gloo ranks against
the rows put together in one process.
"""

from __future__ import annotations

import socket

import pytest
import torch
from compiled_collective_ranks import HIDDEN, ROWS, WORLD, compiled_rank, rank_input
from torch.fx.experimental.proxy_tensor import make_fx

import npu_vllm_bridge.collectives  # noqa: F401  (defines the ops)

OPS = torch.ops.npu_vllm_bridge
NO_GROUP = "no-such-group"  # a name no process group has: the fakes must not look it up


def _fake_trace(fn, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _called_ops(graph: torch.fx.GraphModule) -> list:
    return [node.target for node in graph.graph.nodes if node.op == "call_function"]


def test_each_op_traces_on_fake_tensors_without_a_process_group():
    def gather(x):
        out = x.new_empty((WORLD * x.shape[0], x.shape[1]))
        OPS.host_all_gather_(out, x, NO_GROUP)
        return out

    def reduce(x):
        y = x * 2
        OPS.host_all_reduce_(y, NO_GROUP)
        return y

    def exchange(x):
        out = torch.empty_like(x)
        OPS.host_all_to_all_(out, x, NO_GROUP)
        return out

    x = torch.randn(ROWS, HIDDEN)
    for fn, op, rows in (
        (gather, OPS.host_all_gather_.default, WORLD * ROWS),
        (reduce, OPS.host_all_reduce_.default, ROWS),
        (exchange, OPS.host_all_to_all_.default, ROWS),
    ):
        graph = _fake_trace(fn, x)
        assert op in _called_ops(graph), graph.code
        calls = [n for n in graph.graph.nodes if n.target == op]
        assert calls[0].args[-1] == NO_GROUP
        output = next(n for n in graph.graph.nodes if n.op == "output").args[0]
        assert tuple(output.meta["val"].shape) == (rows, HIDDEN)


def test_the_fakes_refuse_outputs_that_do_not_fit():
    x = torch.randn(ROWS, HIDDEN)
    with pytest.raises(ValueError, match=r"out's 4 rows must be a multiple of input's 3"):
        _fake_trace(lambda t: OPS.host_all_gather_(t.new_empty(4, HIDDEN), t, NO_GROUP), x)
    with pytest.raises(ValueError, match=r"out must have input's dtype and shape past dim 0"):
        _fake_trace(lambda t: OPS.host_all_gather_(t.new_empty(6, 5), t, NO_GROUP), x)
    with pytest.raises(ValueError, match=r"host_all_to_all_: out must have input's 3 rows, got 6"):
        _fake_trace(lambda t: OPS.host_all_to_all_(t.new_empty(6, HIDDEN), t, NO_GROUP), x)
    with pytest.raises(ValueError, match=r"float64"):
        _fake_trace(lambda t: OPS.host_all_to_all_(t.double(), t, NO_GROUP), x)


def test_a_group_is_named_by_its_registered_name():
    import torch.distributed as dist

    from npu_vllm_bridge.collectives import group_handle

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="gloo")
        name = group_handle(group)
        assert isinstance(name, str)
        assert dist.distributed_c10d._resolve_process_group(name) is group
    finally:
        dist.destroy_process_group()


def _run_ranks() -> dict[int, list]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=compiled_rank, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_compiled_collectives_equal_eager_and_the_rows_put_together():
    """``torch.compile(fullgraph=True)`` over all three ops on two gloo ranks: twice
    (the second call runs the compiled code with other values), each equal to the eager
    ops, which equal the rows of both ranks put together."""
    results = _run_ranks()
    inputs = [rank_input(r) for r in range(WORLD)]
    for rank in range(WORLD):
        for scale, eager, compiled in ((1, 0, 1), (3, 2, 3)):
            xs = [x * scale for x in inputs]
            expected = (
                torch.cat([x[:ROWS] * 2 for x in xs]),
                sum(x + 1 for x in xs),
                torch.cat([(x - 1)[rank * ROWS : (rank + 1) * ROWS] for x in xs]),
            )
            for name, want, got_eager, got_compiled in zip(
                ("gather", "sum", "exchange"),
                expected,
                results[rank][eager],
                results[rank][compiled],
            ):
                got_eager, got_compiled = (
                    torch.from_numpy(got_eager),
                    torch.from_numpy(got_compiled),
                )
                torch.testing.assert_close(got_eager, want, rtol=1e-6, atol=1e-6, msg=name)
                torch.testing.assert_close(got_compiled, got_eager, rtol=0, atol=0, msg=name)
