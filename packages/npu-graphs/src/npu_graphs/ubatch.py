"""MicroBatchRunner: overlap micro-batches of one batch, captured as one graph per split.

A batch is split along its first (token) dimension into micro-batches. Each runs on
its own thread with its own compute and communication streams; only one thread
issues work at a time, and a thread hands its turn to the next micro-batch with
``ctx.yield_turn()`` (e.g. right after launching a collective on its communication
stream, so the other micro-batch computes meanwhile). The whole overlapped step is
captured as one graph per (batch key, split) and replayed after. Without a split
(or a split of one) the runnable runs once on the whole batch.

On the host backend the streams are stand-ins and the threads still take turns, so
the recorded op order is the overlapped one; on CUDA (and NPU) the streams are real.

Updatable tasks recorded inside micro-batch ``i`` belong to it
(:func:`~npu_graphs.tasks.micro_batch_scope`): :meth:`MicroBatchRunner.replay_step`
hands each micro-batch's tasks that micro-batch's own step, so the halves may differ
in size and content.

The bridge runs vLLM's micro-batch overlap (DBO) on it (``npu_vllm_bridge.graphs.
ubatch_wrapper``). Tested on the host backend and on CUDA.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from npu_graphs.backends import GraphBackend, get_backend
from npu_graphs.modes import RuntimeMode, current_dispatch, graph_dispatch
from npu_graphs.tasks import PerMicroBatch, TaskRegistry, micro_batch_scope
from npu_graphs.wrapper import GraphWrapper


class MicroBatchContext:
    """Handed to the runnable with its micro-batch: index, streams, turn-taking."""

    def __init__(
        self,
        index: int,
        count: int,
        backend: GraphBackend,
        compute_stream: Any,
        comm_stream: Any,
        turns: _Turns | None,
    ) -> None:
        self.index, self.count = index, count
        self.backend = backend
        self.compute_stream, self.comm_stream = compute_stream, comm_stream
        self._turns = turns

    def yield_turn(self) -> bool:
        """Let the next micro-batch issue work; return when it is this one's turn again.

        Returns:
            Whether the turn passed (False when no other micro-batch is left to run).
        """
        if self._turns is None:
            return False
        return self._turns.pass_on(self.index)

    @contextlib.contextmanager
    def communicate(self) -> Iterator[None]:
        """Issue the enclosed work (a collective, say) on the communication stream.

        The communication stream first waits for this micro-batch's compute so far;
        compute issued after the block waits for the communication.
        """
        self.backend.wait_stream(self.comm_stream, self.compute_stream)
        with self.backend.use_stream(self.comm_stream):
            yield
        self.backend.wait_stream(self.compute_stream, self.comm_stream)


class _Turns:
    """One turn at a time among ``count`` threads, handed round-robin to unfinished ones."""

    def __init__(self, count: int) -> None:
        self._go = [threading.Semaphore(0) for _ in range(count)]
        self._finished = [False] * count
        self._lock = threading.Lock()

    def start(self) -> None:
        self._go[0].release()

    def wait(self, index: int) -> None:
        self._go[index].acquire()

    def pass_on(self, index: int) -> bool:
        with self._lock:
            successor = self._next(index)
        if successor is None:
            return False
        self._go[successor].release()
        self._go[index].acquire()
        return True

    def finish(self, index: int) -> None:
        with self._lock:
            self._finished[index] = True
            successor = self._next(index)
        if successor is not None:
            self._go[successor].release()

    def _next(self, index: int) -> int | None:
        count = len(self._go)
        for step in range(1, count):
            candidate = (index + step) % count
            if not self._finished[candidate]:
                return candidate
        return None


class MicroBatchRunner:
    """Run ``runnable(inputs, ctx)`` over micro-batches with overlap, as one graph per split.

    Args:
        runnable: ``runnable(inputs, ctx: MicroBatchContext) -> Tensor | tuple[Tensor, ...]``;
            ``inputs`` is a tensor (or tuple of tensors) of the micro-batch's tokens
            (first dimension), outputs have one row per input token.
        backend: graph backend (instance, name or device).
        mode: the dispatch mode under which the runner captures and replays (FULL);
            under any other mode it runs the micro-batches eagerly.
        tasks: registry for :func:`~npu_graphs.call_task` inside the micro-batches.
        name: used in logs and errors.
    """

    def __init__(
        self,
        runnable: Callable[[Any, MicroBatchContext], Any],
        *,
        backend: GraphBackend | str | torch.device | None = None,
        mode: RuntimeMode = RuntimeMode.FULL,
        tasks: TaskRegistry | None = None,
        name: str = "ubatch",
    ) -> None:
        if not callable(runnable):
            raise TypeError(f"runnable must be callable, got {type(runnable).__name__}")
        self.runnable = runnable
        self.backend = get_backend(backend)
        self.mode = mode
        self._graph = GraphWrapper(
            self._run_overlapped, backend=self.backend, mode=mode, tasks=tasks, name=name
        )
        self._streams: list[tuple[Any, Any]] = []

    def __call__(self, inputs: Any, splits: Sequence[int] | None = None) -> Any:
        """Run the batch ``inputs``, split into micro-batches of ``splits`` tokens.

        Under the runner's dispatch mode, the overlapped run is captured on first sight
        of (dispatch key, splits) and replayed after; ``inputs`` must then be the same
        static buffers each time.

        Raises:
            ValueError: ``splits`` do not add up to the batch's tokens, or hold a count < 1.
        """
        num_tokens = _num_tokens(inputs)
        if splits is None or len(splits) < 2:
            if splits is not None and sum(splits) != num_tokens:
                raise ValueError(f"splits {list(splits)} do not add up to {num_tokens} tokens")
            comm_stream = self._stream_pair(0)[1]
            current = self.backend.current_stream()
            single = MicroBatchContext(0, 1, self.backend, current, comm_stream, None)
            return self.runnable(inputs, single)
        splits = tuple(splits)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in splits):
            raise ValueError(f"splits must be ints >= 1, got {list(splits)}")
        if sum(splits) != num_tokens:
            raise ValueError(
                f"splits {list(splits)} add up to {sum(splits)}, the batch has {num_tokens} tokens"
            )
        state = current_dispatch()
        if state.mode is not self.mode:
            return self._run_overlapped(inputs, splits)
        key = self.graph_key(state.key, splits)
        with graph_dispatch(self.mode, key):
            return self._graph(inputs, splits)

    def has_graph(self, key: Hashable, splits: Sequence[int]) -> bool:
        """True if the overlapped run of ``splits`` under batch ``key`` is captured."""
        return self._graph.has_graph(self.graph_key(key, splits))

    @staticmethod
    def graph_key(key: Hashable, splits: Sequence[int]) -> Hashable:
        """The key the overlapped graph of ``splits`` under batch ``key`` is kept under
        (in the runner's graphs and its task registry)."""
        return (key, tuple(splits))

    def replay_step(
        self, key: Hashable, splits: Sequence[int], inputs: Any, steps: Sequence[Any]
    ) -> Any:
        """Replay the overlapped graph of ``splits`` under ``key`` with the tasks of
        micro-batch ``i`` brought to ``steps[i]``, in the order the backend takes
        (:meth:`GraphWrapper.replay_step`: on the NPU the replay is launched first and
        each task waits on the device for its update); returns its outputs.

        Raises:
            ValueError: not one step per micro-batch, or no task registry.
            KeyError: no graph of ``splits`` under ``key``.
            TaskUpdateError: a step does not fit what its micro-batch captured.
        """
        splits = tuple(splits)
        if len(steps) != len(splits):
            raise ValueError(
                f"{len(splits)} micro-batches {list(splits)} need one step each, got {len(steps)}"
            )
        if self._graph.tasks is None:
            raise ValueError("this MicroBatchRunner has no task registry (tasks=) to update")
        graph_key = self.graph_key(key, splits)
        return self._graph.replay_step(graph_key, PerMicroBatch(steps), inputs, splits)

    def reset(self) -> None:
        """Drop every captured overlapped graph and its tasks."""
        self._graph.reset()

    def _stream_pair(self, index: int) -> tuple[Any, Any]:
        while len(self._streams) <= index:
            self._streams.append((self.backend.new_stream(), self.backend.new_stream()))
        return self._streams[index]

    def _run_overlapped(self, inputs: Any, splits: tuple[int, ...]) -> Any:
        parts = _split(inputs, splits)
        turns = _Turns(len(parts))
        contexts = [
            MicroBatchContext(i, len(parts), self.backend, *self._stream_pair(i), turns)
            for i in range(len(parts))
        ]
        parent = self.backend.current_stream()
        for ctx in contexts:
            self.backend.wait_stream(ctx.compute_stream, parent)
            self.backend.wait_stream(ctx.comm_stream, parent)
        results: list[Any] = [None] * len(parts)
        errors: list[BaseException] = []
        ready = threading.Barrier(len(parts) + 1)
        threads = [
            threading.Thread(
                target=self._thread_body,
                args=(ctx, parts[ctx.index], turns, ready, results, errors),
            )
            for ctx in contexts
        ]
        for thread in threads:
            thread.start()
        try:
            ready.wait()
            turns.start()
        except threading.BrokenBarrierError:
            pass  # a thread failed before starting; its error is raised below
        for thread in threads:
            thread.join()
        for ctx in contexts:
            self.backend.wait_stream(parent, ctx.compute_stream)
            self.backend.wait_stream(parent, ctx.comm_stream)
        if errors:
            raise errors[0]
        return _concat(results)

    def _thread_body(
        self,
        ctx: MicroBatchContext,
        part: Any,
        turns: _Turns,
        ready: threading.Barrier,
        results: list[Any],
        errors: list[BaseException],
    ) -> None:
        had_turn = False
        try:
            with self.backend.join_capture():
                ready.wait()
                turns.wait(ctx.index)
                had_turn = True
                try:
                    with self.backend.use_stream(ctx.compute_stream), micro_batch_scope(ctx.index):
                        results[ctx.index] = self.runnable(part, ctx)
                finally:
                    turns.finish(ctx.index)
        except BaseException as exc:  # re-raised by the calling thread
            errors.append(exc)
            ready.abort()
            if not had_turn:
                turns.finish(ctx.index)


def _num_tokens(inputs: Any) -> int:
    first = inputs[0] if isinstance(inputs, tuple) else inputs
    if not isinstance(first, torch.Tensor):
        raise TypeError(
            f"inputs must be a tensor or a tuple of tensors, got {type(first).__name__}"
        )
    return first.shape[0]


def _split(inputs: Any, splits: tuple[int, ...]) -> list[Any]:
    if isinstance(inputs, tuple):
        columns = [t.split(list(splits)) for t in inputs]
        return [tuple(c[i] for c in columns) for i in range(len(splits))]
    return list(inputs.split(list(splits)))


def _concat(results: list[Any]) -> Any:
    if isinstance(results[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*results))
    return torch.cat(results)
