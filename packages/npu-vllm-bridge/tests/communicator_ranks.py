"""One rank of the host communicator test (a module of its own, so that spawned rank
processes can import it)."""

from __future__ import annotations

import os

import torch

SIZES = [2, 3]  # rows each of the two ranks brings to the gather
HIDDEN = 4


def rank_rows(rank: int, rows: int) -> torch.Tensor:
    """What rank ``rank`` brings: ``rows`` rows, distinct per rank and row."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, HIDDEN, generator=generator)


COMMUNICATORS = {
    "host": "npu_vllm_bridge.host.communicator:HostCommunicator",
    "npu": "npu_vllm_bridge.worker.npu_communicator:NPUCommunicator",
}


def communicator_rank(rank: int, port: int, queue, kind: str = "host") -> None:
    import importlib

    import torch.distributed as dist

    module, name = COMMUNICATORS[kind].split(":")
    communicator = getattr(importlib.import_module(module), name)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(SIZES)
    )
    try:
        group = dist.group.WORLD
        comm = communicator(group, torch.device("cpu"), group, unique_name="dp")
        mine = rank_rows(rank, SIZES[rank])
        gathered = comm.all_gatherv(mine, dim=0, sizes=SIZES)
        gathered_t = comm.all_gatherv([mine.t().contiguous()], dim=1, sizes=SIZES)[0]
        everyone = rank_rows(rank, sum(SIZES)) * (rank + 1)
        scattered = comm.reduce_scatterv(everyone, dim=0, sizes=SIZES)
        equal = comm.all_gatherv(rank_rows(rank, 2), dim=0)
        queue.put((rank, [t.numpy() for t in (gathered, gathered_t, scattered, equal)]))
    finally:
        dist.destroy_process_group()
    queue.close()
    queue.join_thread()
    # Importing vLLM leaves native threads whose teardown at interpreter exit can abort
    # the process after its work is done ("terminate called without an active exception").
    os._exit(0)
