"""The host backend's recorded graphs behave like device graphs (fixed outputs, baked args)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from npu_graphs import GraphCaptureError, GraphReplayError, TaskUpdateError, get_backend

STATE = {"scale": 2.0}
SMALL = torch.arange(2.0)
_LIB = torch.library.Library("npu_graphs_test", "DEF")
_LIB.define("scale_by_global(Tensor x) -> Tensor")


def _scale_by_global(x: torch.Tensor) -> torch.Tensor:
    return x * STATE["scale"]  # reads global state at call time, like vLLM's attention op


_LIB.impl("scale_by_global", _scale_by_global, "CPU")
_LIB.define("make_zeros(int n) -> Tensor")
_LIB.impl("make_zeros", lambda n: torch.zeros(n), "CompositeExplicitAutograd")


@pytest.fixture
def host():
    return get_backend("host")


def capture(host, fn):
    graph = host.new_graph()
    with host.capture(graph):
        out = fn()
    return graph, out


def test_replay_recomputes_into_the_captured_outputs(host):
    x = torch.randn(3, 4)
    w = torch.randn(4, 4)
    graph, out = capture(host, lambda: torch.relu(x @ w) + 1)
    x.copy_(torch.randn(3, 4))
    host.replay(graph)
    torch.testing.assert_close(out, torch.relu(x @ w) + 1)


def test_host_arguments_stay_baked(host):
    x = torch.arange(8.0)
    n = 4
    graph, out = capture(host, lambda: x[:n].sum().reshape(1))
    n = 6
    x.mul_(10)
    host.replay(graph)
    assert out.item() == x[:4].sum().item()


def test_in_place_ops_run_once_per_replay(host):
    counter = torch.zeros(1)
    graph, _ = capture(host, lambda: counter.add_(1))
    assert counter.item() == 1  # host capture executes once
    host.replay(graph)
    host.replay(graph)
    assert counter.item() == 3


def test_custom_op_reading_global_state_is_recorded_below(host):
    x = torch.ones(2)
    graph, out = capture(host, lambda: torch.ops.npu_graphs_test.scale_by_global(x))
    STATE["scale"] = 5.0
    try:
        host.replay(graph)
        torch.testing.assert_close(out, torch.full((2,), 2.0))  # stale, as on a device
        assert all(op.func.namespace == "aten" for op in graph.ops)
    finally:
        STATE["scale"] = 2.0


def test_host_sync_inside_capture_is_refused(host):
    x = torch.ones(2)
    graph = host.new_graph()
    with pytest.raises(GraphCaptureError, match="host value"), host.capture(graph):
        float(x.sum().item())
    assert not graph.captured and graph.num_ops == 0
    with pytest.raises(GraphReplayError, match="not been captured"):
        host.replay(graph)


def test_unrecorded_ops_run_at_capture_and_not_at_replay(host):
    x = torch.ones(2)
    counts = torch.tensor([3, 3])

    def step():
        with host.unrecorded():
            assert counts[0] == 3  # reads a value: refused if recorded
            counts.add_(1)  # runs once, at capture
        return x * 2

    graph, out = capture(host, step)
    assert counts.tolist() == [4, 4]
    x.fill_(5.0)
    host.replay(graph)
    torch.testing.assert_close(out, torch.full((2,), 10.0))
    assert counts.tolist() == [4, 4]  # not replayed
    with host.unrecorded():  # outside a capture: just runs
        counts.add_(1)
    assert counts.tolist() == [5, 5]


def test_one_capture_at_a_time(host):
    outer, inner = host.new_graph(), host.new_graph()
    with (
        host.capture(outer),
        pytest.raises(GraphCaptureError, match="another host graph capture"),
        host.capture(inner),
    ):
        pass
    assert outer.captured and not host.is_capturing()


def test_capture_twice_and_wrong_graph_type(host):
    graph, _ = capture(host, lambda: torch.ones(1) + 1)
    with pytest.raises(GraphCaptureError, match="already captured"), host.capture(graph):
        pass
    with pytest.raises(TypeError, match="HostGraph"), host.capture(object()):
        pass


def _group(host, fn):
    graph = host.new_graph()
    with host.capture(graph):
        token = host.task_group_begin(graph, None)
        out = fn()
        handle = host.task_group_end(graph, None, token)
    return graph, handle, out


def test_task_update_swaps_host_arguments(host):
    x = torch.arange(6.0)
    graph, handle, out = _group(host, lambda: torch.mul(x, torch.tensor([1.0] * 6)))
    host.update_tasks(graph, [(handle, lambda: torch.mul(x, torch.tensor([2.0] * 6)))])
    torch.testing.assert_close(out, x)  # an update executes nothing
    host.replay(graph)
    torch.testing.assert_close(out, x * 2)


@pytest.mark.parametrize(
    ("issue", "match"),
    [
        (lambda x: (x + 1) * 2, "more ops than the 1 captured"),
        (lambda x: x - 1, "captured aten.add.Tensor, the update issued aten.sub.Tensor"),
        (lambda x: x.clone(), "captured aten.add.Tensor, the update issued aten.clone"),
        (lambda x: None, "issued 0 ops, the capture recorded 1"),
        (lambda x: SMALL + 1, "input shapes"),
    ],
)
def test_task_update_must_issue_the_same_ops(host, issue, match):
    x = torch.arange(4.0)
    graph, handle, out = _group(host, lambda: x + 1)
    before = list(graph.ops)
    with pytest.raises(TaskUpdateError, match=match):
        host.update_tasks(graph, [(handle, lambda: issue(x))])
    assert graph.ops == before  # nothing half-applied
    host.replay(graph)
    torch.testing.assert_close(out, x + 1)


def test_view_length_changes_are_refused(host):
    x = torch.arange(8.0)
    graph, handle, _ = _group(host, lambda: x[:4] * 2)
    with pytest.raises(TaskUpdateError, match="shape"):
        host.update_tasks(graph, [(handle, lambda: x[:5] * 2)])
    with pytest.raises(TaskUpdateError, match="views its base differently"):
        host.update_tasks(graph, [(handle, lambda: x[1:5] * 2)])


def test_update_during_capture_is_refused(host):
    graph, handle, _ = _group(host, lambda: torch.ones(2) * 3)
    other = host.new_graph()
    with host.capture(other), pytest.raises(GraphCaptureError, match="task update while"):
        host.update_tasks(graph, [(handle, None)])


def test_memory_in_use_counts_captured_tensors(host):
    before = host.memory_in_use()
    graph, _ = capture(host, lambda: torch.ones(1024) * 2)
    assert host.memory_in_use() - before >= 1024 * 4
    assert graph.nbytes() >= 1024 * 4


def test_custom_op_without_tensor_arguments_is_refused(host):
    graph = host.new_graph()
    with pytest.raises(GraphCaptureError, match="takes no tensor"), host.capture(graph):
        torch.ops.npu_graphs_test.make_zeros(3)
    assert not graph.captured


def test_task_groups_only_inside_their_capture(host):
    graph = host.new_graph()
    with pytest.raises(GraphCaptureError, match="task_group_begin outside"):
        host.task_group_begin(graph, None)
    with pytest.raises(GraphCaptureError, match="task_group_end outside"):
        host.task_group_end(graph, None, 0)


@torch.inference_mode()
def test_alias_annotated_ops_that_copied_are_redone(host):
    x = torch.arange(6.0).reshape(2, 3)
    graph = host.new_graph()
    with host.capture(graph):
        converted = x.to(torch.float64)  # one aten.to op in inference mode: a copy
        flattened = x.t().reshape(6)  # not viewable: a copy
    x.add_(1)
    host.replay(graph)
    torch.testing.assert_close(converted, x.to(torch.float64))
    torch.testing.assert_close(flattened, x.t().reshape(6))


_LIB.define("scale_into(Tensor(a!) out, Tensor x, Tensor factor) -> ()")


def _scale_into(out: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> None:
    """Work no recorder can see: float32 memory read and written outside torch."""
    n = x.numel()
    src = (ctypes.c_float * n).from_address(x.data_ptr())
    dst = (ctypes.c_float * n).from_address(out.data_ptr())
    scale = ctypes.c_float.from_address(factor.data_ptr()).value
    for i in range(n):
        dst[i] = src[i] * scale


_LIB.impl("scale_into", _scale_into, "CPU")


def test_ops_registered_whole_are_replayed_as_one_op(host):
    """A kernel whose work happens outside torch (as a GEMM library's does) is lost when
    recorded below; registered whole, it is replayed like an aten op."""
    x, factor = torch.arange(4.0), torch.tensor([3.0])

    def fn():
        out = torch.empty(4)
        torch.ops.npu_graphs_test.scale_into(out, x, factor)
        return out * 1.0

    graph, out = capture(host, fn)
    host.finish_capture(graph, out)
    x.add_(1)
    assert all(op.func.namespace == "aten" for op in graph.ops)  # recorded below: blind
    replayed = host.replay(graph)  # the kernel's work is lost: never x * 3
    assert not torch.allclose(replayed, torch.arange(1.0, 5.0) * 3)
    host.record_whole(torch.ops.npu_graphs_test.scale_into.default)
    whole, whole_out = capture(host, fn)
    host.finish_capture(whole, whole_out)
    assert any(op.func.namespace == "npu_graphs_test" for op in whole.ops)
    torch.testing.assert_close(host.replay(whole), x * 3)
    with pytest.raises(TypeError, match="OpOverload"):
        host.record_whole(lambda t: t)


def test_finished_graphs_keep_no_intermediates(host):
    """After finish_capture a graph keeps nothing between replays; a replay's peak of
    live intermediates follows liveness (chained temporaries reuse freed storage)."""
    x = torch.randn(256, 256)

    def chain():
        y = x
        for _ in range(8):
            y = torch.tanh(y) * 0.5  # each temporary dies after the next op
        return y

    graph, out = capture(host, chain)
    kept_before = graph.nbytes()
    host.finish_capture(graph, out)
    one = 256 * 256 * 4
    assert kept_before >= 16 * one  # every temporary, while outputs are unknown
    assert graph.nbytes() == 0
    assert 2 * one <= graph.peak_transient_bytes <= 3 * one
    torch.testing.assert_close(host.replay(graph), chain())


def test_tasks_recorded_whole_keep_no_capture_tensors(host):
    """A finished graph whose task is recorded whole keeps none of the task's
    capture-time arguments or outputs; an update swaps only its host arguments."""
    x = torch.randn(128, 128)
    one = 128 * 128 * 4

    def scaled(y, out, *, factor):
        torch.mul(y, factor, out=out)
        return out

    def forward():
        y = torch.tanh(x)  # an intermediate the task reads
        out = torch.empty_like(y)
        stream = host.current_stream()
        result, handle = host.record_task(graph, stream, scaled, (y, out), {}, {"factor": 2.0})
        forward.handle = handle
        return result + 1

    graph = host.new_graph()
    with host.capture(graph):
        captured = forward()
    host.finish_capture(graph, captured)
    assert graph.nbytes() == 0
    assert graph.peak_transient_bytes <= 3 * one
    torch.testing.assert_close(host.replay(graph), torch.tanh(x) * 2 + 1)

    issue = SimpleNamespace(host_values={"factor": 3.0})  # what TaskRegistry hands over
    host.update_tasks(graph, [(forward.handle, issue)])
    torch.testing.assert_close(host.replay(graph), torch.tanh(x) * 3 + 1)
    assert graph.nbytes() == 0


def test_chained_graphs_read_the_inputs_they_are_given(host):
    """Piecewise graphs: a piece's input is the previous piece's fresh output; its replay
    reads that tensor (and views of it), not the one captured."""
    from npu_graphs import GraphWrapper, RuntimeMode, graph_dispatch

    weight = torch.randn(8, 8)
    first = GraphWrapper(lambda x: torch.tanh(x @ weight), backend=host, mode=RuntimeMode.PIECEWISE)
    second = GraphWrapper(
        lambda y, x: (y[:, :4] * 2 + x[:, 4:], y), backend=host, mode=RuntimeMode.PIECEWISE
    )

    def step(x):
        with graph_dispatch(RuntimeMode.PIECEWISE, x.shape[0]):
            y = first(x)
            return second(y, x)

    def eager(x):
        y = torch.tanh(x @ weight)
        return y[:, :4] * 2 + x[:, 4:], y

    for _ in range(2):  # capture, then replays on new inputs
        for rows in (4, 2):
            x = torch.randn(rows, 8)
            for got, want in zip(step(x), eager(x)):
                torch.testing.assert_close(got, want)
    assert first.keys() == [4, 2] and second.keys() == [4, 2]


def test_replay_checks_its_inputs(host):
    x = torch.randn(4)
    graph = host.new_graph()
    with host.capture(graph):
        out = x * 2
    host.finish_capture(graph, out, [x])
    torch.testing.assert_close(host.replay(graph, [x + 1]), (x + 1) * 2)
    with pytest.raises(GraphReplayError, match="captured with 1 input tensors"):
        host.replay(graph)
    with pytest.raises(GraphReplayError, match=r"captured as \(4,\) torch.float32, replayed with"):
        host.replay(graph, [torch.randn(5)])


@pytest.mark.parametrize(
    "value",
    [
        "tensor",
        "nested tuples and lists with scalars",
        "dict",
        "namedtuple holding a dict",
        "torch.return_types",
        "OrderedDict",
        "torch.Size",
        "dtype, device, str",
        "Parameter",
    ],
)
def test_tensor_leaves_are_the_pytree_tensor_leaves(value: str) -> None:
    """The recorder's fast walk finds the tensors ``tree_leaves`` finds, in its order."""
    import collections

    from torch.utils._pytree import tree_leaves

    from npu_graphs.backends.host_program import tensor_leaves

    t = [torch.zeros(i + 1) for i in range(5)]
    pair = collections.namedtuple("pair", "a b")
    structures = {
        "tensor": t[0],
        "nested tuples and lists with scalars": (t[0], 1, None, [t[1], (t[2],)], 2.5),
        "dict": {"x": t[3], "y": [t[4], 2.0], "z": None},
        "namedtuple holding a dict": pair(t[0], {"q": t[1]}),
        "torch.return_types": torch.max(torch.arange(12.0).view(3, 4), 1),
        "OrderedDict": collections.OrderedDict(b=t[2], a=t[1]),
        "torch.Size": torch.Size([2, 3]),
        "dtype, device, str": (torch.float32, torch.device("cpu"), "s"),
        "Parameter": torch.nn.Parameter(torch.ones(2)),
    }
    tree = structures[value]
    expected = [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
    found = tensor_leaves(tree)
    assert [id(x) for x in found] == [id(x) for x in expected]
