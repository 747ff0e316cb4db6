"""Host graphs hold about what one eager forward allocates at its peak, whatever their number.

The reference is independent of the graph's own accounting: a dispatch mode that
tracks every storage an eager forward creates until its last tensor dies, and reports
the peak of bytes alive at once (weights, inputs and outputs excluded: they exist
before and after the forward).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from npu_graphs.backends.host import HostGraphBackend

HIDDEN, LAYERS, SIZES = 256, 6, (1, 4, 16, 64)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created under the mode and alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list] = {}  # storage address -> [nbytes, live tensors]
        self.external: set[int] = set()  # storages that existed before (weights, inputs)
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                address = leaf.untyped_storage().data_ptr()
                if address not in self.live:
                    self.external.add(address)
        outputs = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(outputs):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return outputs

    def _track(self, tensor: torch.Tensor) -> None:
        address = tensor.untyped_storage().data_ptr()
        if address in self.external:
            return
        entry = self.live.get(address)
        if entry is None:
            entry = self.live[address] = [tensor.untyped_storage().nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(tensor, self._release, address)

    def _release(self, address: int) -> None:
        entry = self.live[address]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[address]


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
