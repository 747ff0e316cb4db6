"""One rank of the compiled-collectives test (a module of its own, so that spawned rank
processes can import it): the bridge's collective ops run eagerly and through
``torch.compile(fullgraph=True)``, on the same inputs."""

from __future__ import annotations

import os

import torch

WORLD = 2
ROWS, HIDDEN = 3, 4


def rank_input(rank: int) -> torch.Tensor:
    """What rank ``rank`` brings: ``WORLD * ROWS`` rows, distinct per rank and row."""
    generator = torch.Generator().manual_seed(200 + rank)
    return torch.randn(WORLD * ROWS, HIDDEN, generator=generator)


def collectives(x: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    """Every collective op of the bridge once, each on tensors made inside (as a model
    makes them): the gather of ``x``'s first rows, the sum of ``x``, the exchange."""
    from npu_vllm_bridge.collectives import all_gather_, all_reduce_, all_to_all_

    first = x[:ROWS] * 2
    gathered = first.new_empty((WORLD * ROWS, HIDDEN))
    all_gather_(gathered, first, group)
    summed = x + 1
    all_reduce_(summed, group)
    exchanged = torch.empty_like(x)
    all_to_all_(exchanged, x - 1, group)
    return gathered + 0, summed * 1, exchanged.clone()


def compiled_rank(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        group = dist.new_group(list(range(WORLD)), backend="gloo")
        x = rank_input(rank)
        eager = collectives(x, group)
        compiled = torch.compile(collectives, fullgraph=True, backend="eager")
        first = compiled(x, group)
        second = compiled(x * 3, group)  # the compiled code again, other values
        eager_second = collectives(x * 3, group)
        queue.put((rank, [[t.numpy() for t in ts] for ts in (eager, first, eager_second, second)]))
    finally:
        dist.destroy_process_group()
    queue.close()
    queue.join_thread()
    os._exit(0)  # see communicator_ranks.py
