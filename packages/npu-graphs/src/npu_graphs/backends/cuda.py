"""CUDA graphs (``torch.cuda.CUDAGraph``).

CUDA graphs have no task update: an updatable task keeps its step state in fixed
device buffers, refreshed by ``copy_`` on the current stream before replay (stream
order, no synchronize). Host values passed to a task are baked in, and a step that
changes them is refused by the task registry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from npu_graphs.backends.base import GraphBackend


class CudaGraphBackend(GraphBackend):
    """Graphs of CUDA work on the current CUDA device."""

    name = "cuda"
    device_type = "cuda"
    supports_task_update = False
    weak_ref_outputs = True
    capture_executes = False
    warmup_runs = 1

    def __init__(self, capture_error_mode: str = "global") -> None:
        self.capture_error_mode = capture_error_mode
        self._capture_device: int | None = None
        self._pools: list[Any] = []

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def new_pool(self) -> Any:
        """A graph memory pool that stays alive as long as this backend.

        A bare ``graph_pool_handle()`` lives only while some graph uses it: once every
        graph of the pool is gone, capturing into the same handle again trips the
        caching allocator (``use_count > 0`` assertion). A ``torch.cuda.MemPool`` holds
        its own reference to the pool.
        """
        mem_pool = torch.cuda.MemPool()
        self._pools.append(mem_pool)
        return mem_pool.id

    @contextlib.contextmanager
    def capture(self, graph: Any, *, pool: Any = None, stream: Any = None) -> Iterator[None]:
        self._capture_device = torch.cuda.current_device()
        try:
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode=self.capture_error_mode
            ):
                yield
        finally:
            self._capture_device = None

    def replay(self, graph: Any, inputs: Any = None) -> None:  # reads captured addresses
        graph.replay()

    def is_capturing(self) -> bool:
        return self._capture_device is not None or torch.cuda.is_current_stream_capturing()

    def join_capture(self) -> contextlib.AbstractContextManager:
        if self._capture_device is None:
            return contextlib.nullcontext()
        return torch.cuda.device(self._capture_device)

    def suppress_cache_flush(self) -> contextlib.AbstractContextManager:
        return mock.patch("torch.cuda.empty_cache", lambda: None)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream()

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_in_use(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def weak_ref(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of ``tensor``'s memory that does not own it (the graph pool keeps it)."""
        storage = tensor.untyped_storage()
        borrowed = torch._C._construct_storage_from_data_pointer(
            storage.data_ptr(), tensor.device, storage.nbytes()
        )
        view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return view.set_(borrowed, tensor.storage_offset(), tensor.shape, tensor.stride())
