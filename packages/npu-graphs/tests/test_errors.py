"""Every bad input of the dispatch context, wrapper, registry and backend lookup is refused."""

from __future__ import annotations

import gc

import pytest
import torch
from npu_graphs_cases import segment_mix

import npu_graphs
from npu_graphs import (
    GraphCaptureError,
    GraphWrapper,
    RuntimeMode,
    TaskRegistry,
    TaskUpdateError,
    get_backend,
    graph_dispatch,
)
from npu_graphs.backends.host import HostGraphBackend


def test_graph_dispatch_arguments():
    with (
        pytest.raises(TypeError, match="mode must be a RuntimeMode, got str"),
        graph_dispatch("full", 1),
    ):
        pass
    with pytest.raises(ValueError, match="needs a batch key"), graph_dispatch(RuntimeMode.FULL):
        pass
    with pytest.raises(TypeError, match="hashable"), graph_dispatch(RuntimeMode.FULL, [1]):
        pass
    assert npu_graphs.current_dispatch().mode is RuntimeMode.NONE


def test_wrapper_arguments():
    with pytest.raises(TypeError, match="runnable must be callable"):
        GraphWrapper(1, backend="host")
    with pytest.raises(ValueError, match="FULL or PIECEWISE"):
        GraphWrapper(abs, backend="host", mode=RuntimeMode.NONE)
    with pytest.raises(TypeError, match="tasks must be a TaskRegistry"):
        GraphWrapper(abs, backend="host", tasks={})
    wrapper = GraphWrapper(abs, backend="host")
    with pytest.raises(KeyError, match="no graph captured for key 3"):
        wrapper.replay(3)
    with graph_dispatch(RuntimeMode.FULL, 3):
        wrapper(torch.ones(2))
    with pytest.raises(ValueError, match="already captured"):
        wrapper.capture(3, torch.ones(2))
    wrapper.reset()
    assert wrapper.keys() == []


def test_wrapper_forwards_attributes_to_the_runnable():
    class Model:
        hidden_size = 7

        def __call__(self, x):
            return x

    wrapper = GraphWrapper(Model(), backend="host")
    assert wrapper.hidden_size == 7 and isinstance(wrapper.unwrap(), Model)
    with pytest.raises(AttributeError):
        _ = wrapper.missing


def test_registry_update_errors():
    registry = TaskRegistry("main")
    with pytest.raises(ValueError, match="'main': no graph captured for key 4"):
        registry.update(4, {"seq_lens": [4]})
    with pytest.raises(ValueError, match="expected_tasks must be an int >= 0"):
        TaskRegistry(expected_tasks=-1)

    def model(x):
        registry.call(segment_mix, x, step={"seq_lens": [4]})
        return registry.update(4, {"seq_lens": [4]})  # during the capture

    wrapper = GraphWrapper(model, backend="host", tasks=registry)
    with (
        graph_dispatch(RuntimeMode.FULL, 4),
        pytest.raises(GraphCaptureError, match=r"update\(4\) during the capture"),
    ):
        wrapper(torch.ones(4, 2))
    assert registry.keys() == []


def test_step_arguments_must_be_keyword_mappings():
    registry = TaskRegistry("main")
    with pytest.raises(TypeError, match="step must be a Mapping"):
        registry.call(segment_mix, torch.ones(2, 2), step=[2])
    with pytest.raises(TypeError, match=r"derive\(step\) must be a Mapping"):
        registry.call(segment_mix, torch.ones(2, 2), step=2, derive=lambda s: s)
    with pytest.raises(TypeError, match="fn must be callable"):
        registry.call(None, step={})


def test_static_and_step_argument_clash():
    registry = TaskRegistry("main")
    wrapper = GraphWrapper(
        lambda x: registry.call(segment_mix, x, seq_lens=[2], step={"seq_lens": [2]}),
        backend="host",
    )
    with (
        graph_dispatch(RuntimeMode.FULL, 2),
        pytest.raises(GraphCaptureError, match="given both as static and step arguments"),
    ):
        wrapper(torch.ones(2, 2))


def test_nested_tasks_are_refused():
    registry = TaskRegistry("main")

    def outer(x, *, seq_lens):
        return registry.call(segment_mix, x, step={"seq_lens": seq_lens})

    wrapper = GraphWrapper(
        lambda x: registry.call(outer, x, step={"seq_lens": [2]}), backend="host"
    )
    with graph_dispatch(RuntimeMode.FULL, 2), pytest.raises(GraphCaptureError, match="nest"):
        wrapper(torch.ones(2, 2))


def test_call_task_inside_a_capture_without_registry_is_refused():
    wrapper = GraphWrapper(
        lambda x: npu_graphs.call_task(segment_mix, x, step={"seq_lens": [2]}), backend="host"
    )
    with (
        graph_dispatch(RuntimeMode.FULL, 2),
        pytest.raises(GraphCaptureError, match="would be baked"),
    ):
        wrapper(torch.ones(2, 2))


def test_fixed_buffer_step_arguments_keep_their_shape():
    registry = TaskRegistry("main")
    lens = torch.tensor([1, 1])  # a device tensor on the host backend: kept in a fixed buffer
    wrapper = GraphWrapper(
        lambda x: registry.call(segment_mix, x, step={"seq_lens": lens}), backend="host"
    )
    x = torch.randn(2, 3)
    with graph_dispatch(RuntimeMode.FULL, 2):
        wrapper(x)
    with pytest.raises(TaskUpdateError, match=r"tensor of shape \(2,\).*got \(3,\)"):
        registry.update(2, {"seq_lens": torch.tensor([1, 1, 0])})
    with pytest.raises(TaskUpdateError, match="got list"):
        registry.update(2, {"seq_lens": [2]})
    registry.update(2, {"seq_lens": torch.tensor([0, 2])})
    with graph_dispatch(RuntimeMode.FULL, 2):
        torch.testing.assert_close(wrapper(x), segment_mix(x, seq_lens=[0, 2]))


class _NoTaskUpdateBackend(HostGraphBackend):
    """Host graphs without task update: the registry's CUDA path, testable on CPU."""

    name = "host-no-task-update"
    supports_task_update = False


def test_baked_host_values_cannot_change_without_task_update():
    backend = _NoTaskUpdateBackend()
    registry = TaskRegistry("main")
    wrapper = GraphWrapper(
        lambda x, step: registry.call(segment_mix, x, step=step), backend=backend
    )
    x = torch.randn(4, 3)
    with graph_dispatch(RuntimeMode.FULL, 4):
        wrapper(x, {"seq_lens": [2, 2]})
    registry.update(4, {"seq_lens": [2, 2]})  # same values: fine
    with pytest.raises(TaskUpdateError, match="baked into the graph"):
        registry.update(4, {"seq_lens": [1, 3]})


def test_backend_lookup():
    assert get_backend("host") is get_backend("cpu") is get_backend(torch.device("cpu"))
    assert get_backend(get_backend("host")).name == "host"
    assert "npu" in npu_graphs.available_backends()
    with pytest.raises(ValueError, match="unknown graph backend or device 'tpu'"):
        get_backend("tpu")
    with pytest.raises(ValueError, match="no graph backend for device type 'meta'"):
        get_backend(torch.device("meta"))
    with pytest.raises(TypeError, match="got int"):
        get_backend(3)
    with pytest.raises(TypeError, match="non-empty str"):
        npu_graphs.register_backend("", HostGraphBackend)


def test_npu_backend_without_torch_npu_says_what_is_missing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails, as without CANN
    from npu_graphs.backends.npu import NpuGraphBackend

    with pytest.raises(ImportError, match="needs torch_npu"):
        NpuGraphBackend()


def test_debug_address_check_counts_arguments():
    wrapper = GraphWrapper(lambda *xs: xs[0] + 1, backend="host", debug_check_addresses=True)
    x = torch.ones(2)
    with graph_dispatch(RuntimeMode.FULL, 2):
        wrapper(x)
        with pytest.raises(ValueError, match="captured with 1 argument leaves, called with 2"):
            wrapper(x, x)


def test_capture_suppresses_gc_and_reports_keys_time_and_memory():
    seen = {}

    def model(x):
        seen["gc_enabled"], seen["collected"] = (
            gc.isenabled(),
            gc.collect(),
        )
        return x * 2

    backend = get_backend("host")
    wrapper = GraphWrapper(model, backend=backend)
    inputs = {n: torch.ones(n * 256) for n in (4, 2, 1)}

    def capture_one(n):
        with graph_dispatch(RuntimeMode.FULL, n):
            wrapper(inputs[n])

    report = npu_graphs.capture_all([4, 2, 1], capture_one, backend=backend, progress=False)
    assert seen == {"gc_enabled": False, "collected": 0}
    assert report.keys == (4, 2, 1) and wrapper.keys() == [4, 2, 1]
    # Host graphs share one pool: the largest replay's output (4 * 256 floats) counts once.
    assert report.memory_bytes == 4 * 256 * 4 and report.seconds >= 0
    assert "captured 3 graphs" in str(report)
    assert gc.isenabled()
