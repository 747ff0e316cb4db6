"""One gloo rank of ``test_npu_sim_parallel``'s communicator test: the NPU platform's
communicator captured in a simulated ``NPUGraph`` and replayed on new inputs.

A module of its own so that a spawned rank process can import it by name (pytest's
``importlib`` import mode names test modules after their folder, which is no package).
"""

from __future__ import annotations

from pathlib import Path

import torch

SIZES = [2, 3]  # rows each rank brings to the variable-size collectives
WIDTH = 4


def rank_rows(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s rows at ``step``: every value ``100 * step + 10 * rank + row``."""
    rows = torch.arange(SIZES[rank], dtype=torch.float16)[:, None].expand(-1, WIDTH)
    return rows + 100 * step + 10 * rank


def communicator_rank(rank: int, port: int, wheel_dir: str, results) -> None:
    import torch.distributed as dist
    from stand_in_install import installed_stand_in
    from torch_npu_schemas import download_wheel, read_wheel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    api = read_wheel(download_wheel(Path(wheel_dir)))
    with installed_stand_in(api):
        from npu_vllm_bridge.worker.npu_communicator import NPUCommunicator

        group = dist.group.WORLD
        communicator = NPUCommunicator(cpu_group=group, device_group=group)
        mine = rank_rows(rank, step=0)
        everyone = torch.zeros(sum(SIZES), WIDTH, dtype=torch.float16)
        graph, stream = torch.npu.NPUGraph(), torch.npu.Stream()
        with torch.npu.graph(graph, stream=stream):
            gathered = communicator.all_gatherv(mine * 1, dim=0, sizes=SIZES)
            scattered = communicator.reduce_scatterv(everyone * 1, dim=0, sizes=SIZES)
            summed = communicator.all_reduce(mine[: min(SIZES)] * 1)
        replays = []
        for step in (1, 2):
            mine.copy_(rank_rows(rank, step))
            everyone.copy_(torch.cat([rank_rows(r, step) for r in range(2)]))
            graph.replay()
            replays.append([t.tolist() for t in (gathered, scattered, summed)])
        results.put((rank, replays, torch.npu.runtime.stats["captured_collectives"]))
    dist.destroy_process_group()
