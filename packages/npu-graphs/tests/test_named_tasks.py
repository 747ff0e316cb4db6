"""Named tasks: each task of a graph takes its own entry of the step (one per layer)."""

from __future__ import annotations

import pytest
import torch

from npu_graphs import (
    GraphWrapper,
    RuntimeMode,
    TaskRegistry,
    TaskUpdateError,
    call_task,
    graph_dispatch,
)


def _scaled(x: torch.Tensor, out: torch.Tensor, *, lengths: list[int]) -> None:
    """A host-argument op: ``out[i] = x[i] * lengths[i]`` (the lengths are baked at capture)."""
    out.copy_(x * torch.tensor(lengths, dtype=x.dtype).unsqueeze(-1))


def _two_layers(x: torch.Tensor, steps: dict[str, list[int]]) -> torch.Tensor:
    first, second = torch.empty_like(x), torch.empty_like(x)
    call_task(_scaled, x, first, step=steps["a"], derive=_lengths, name="a")
    call_task(_scaled, first, second, step=steps["b"], derive=_lengths, name="b")
    return second * 1.0


def _lengths(lengths: list[int]) -> dict[str, list[int]]:
    return {"lengths": lengths}


def test_each_named_task_takes_its_own_entry_of_the_step():
    x = torch.arange(1.0, 5.0).view(2, 2)
    registry = TaskRegistry("layers", expected_tasks=2)
    graph = GraphWrapper(lambda steps: _two_layers(x, steps), backend="host", tasks=registry)
    captured = {"a": [1, 2], "b": [3, 4]}
    with graph_dispatch(RuntimeMode.FULL, "decode"):
        graph(captured)  # capture
    new = {"a": [5, 6], "b": [7, 8]}
    registry.update("decode", new)
    with graph_dispatch(RuntimeMode.FULL, "decode"):
        replayed = graph(new).clone()
    torch.testing.assert_close(replayed, _two_layers(x, new), rtol=0, atol=0)
    # The oracle differs from the capture's step, so a skipped update would show.
    assert not torch.equal(replayed, _two_layers(x, captured))


def test_a_step_without_a_tasks_entry_is_refused_naming_it():
    x = torch.ones(2, 2)
    registry = TaskRegistry("layers")
    graph = GraphWrapper(lambda steps: _two_layers(x, steps), backend="host", tasks=registry)
    with graph_dispatch(RuntimeMode.FULL, "decode"):
        graph({"a": [1, 1], "b": [1, 1]})
    with pytest.raises(TaskUpdateError, match=r"task 'b' takes the step's entry 'b'.*\['a'\]"):
        registry.update("decode", {"a": [2, 2]})
