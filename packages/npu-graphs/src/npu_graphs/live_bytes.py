"""Peak bytes that eager code keeps alive at once: the yardstick for graph memory.

A dispatch mode that tracks every storage created under it until its last tensor
dies. Storages that existed before (weights, inputs) are not counted. Independent
of any graph's own accounting, so graph pools can be compared with it::

    with torch.no_grad(), LiveBytes() as tracker:
        out = model(x)
    peak_intermediates = tracker.peak - out.untyped_storage().nbytes()
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes"]


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
