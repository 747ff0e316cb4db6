"""Host graphs hold about what one eager forward allocates at its peak, whatever their number.

The reference is independent of the graph's own accounting: a dispatch mode that
tracks every storage an eager forward creates until its last tensor dies, and reports
the peak of bytes alive at once (weights, inputs and outputs excluded: they exist
before and after the forward).
"""

from __future__ import annotations

import gc
import weakref

import torch

from npu_graphs.backends.host import HostGraphBackend
from npu_graphs.live_bytes import LiveBytes

HIDDEN, LAYERS, SIZES = 256, 6, (1, 4, 16, 64)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU()]
        layers += [torch.nn.Linear(4 * HIDDEN, HIDDEN), torch.nn.LayerNorm(HIDDEN)]
    return torch.nn.Sequential(*layers).eval()


def _eager_peak(model: torch.nn.Module, x: torch.Tensor) -> int:
    with torch.no_grad():
        tracker = LiveBytes()
        with tracker:
            out = model(x)
        return tracker.peak - out.untyped_storage().nbytes()


def test_graphs_of_every_size_hold_at_most_one_and_a_half_eager_peaks() -> None:
    backend = HostGraphBackend()
    model = _model()
    inputs = {size: torch.randn(size, HIDDEN) for size in SIZES}
    graphs = {}
    with torch.no_grad():
        for size in sorted(SIZES, reverse=True):  # largest first, as device graphs
            graph = backend.new_graph()
            with backend.capture(graph):
                out = model(inputs[size])
            backend.finish_capture(graph, out)
            graphs[size] = graph
        for size in SIZES:
            torch.testing.assert_close(backend.replay(graphs[size]), model(inputs[size]))
    peak = _eager_peak(model, inputs[max(SIZES)])
    own, pool = backend.memory_breakdown()
    held = own + pool
    assert own == 0, own  # nothing lives across replays but inputs and weights
    assert 0.5 * peak <= held <= 1.5 * peak, (held, peak)


def test_a_graph_keeps_no_output_of_its_capture_once_the_caller_drops_it() -> None:
    """Replays return their own outputs, so the capture's are the caller's alone: a
    graph that kept them would hold a batch of activations per captured size."""
    backend = HostGraphBackend()
    model = _model()
    x = torch.randn(64, HIDDEN)
    with torch.no_grad():
        graph = backend.new_graph()
        with backend.capture(graph):
            out = model(x)
        backend.finish_capture(graph, {"hidden": out, "again": [out]})
        captured = weakref.ref(out)
        del out
        gc.collect()
        assert captured() is None, "the graph still holds its capture's output"
        replayed = backend.replay(graph)
        expected = model(x)
    torch.testing.assert_close(replayed["hidden"], expected)
    torch.testing.assert_close(replayed["again"][0], expected)
