"""Parallel vLLM runs on the simulated NPU (``npu_sim.py``), and the NPU platform's
device communicator inside simulated graphs.

The simulation reaches every process of a run: the worker processes of vLLM's
multiprocessing executor (tensor and decode-context parallel ranks) through
``npu_sim_site``'s ``sitecustomize``, and one engine process per data-parallel rank
(``--data-parallel-size``), each of which reports its own NPU counters; the ``NPU`` line
sums them and keeps each under ``ranks``. vLLM's process groups talk through the NPU
platform's communicator (``worker/npu_communicator.py``) over gloo, and a collective
called during a capture is one task of the simulated graph (as torch_npu captures an
HCCL collective), which each replay runs again.

- The communicator's ``all_gatherv`` / ``reduce_scatterv`` / ``all_reduce`` captured in a
  simulated ``NPUGraph`` on two gloo ranks and replayed on new inputs give the sums and
  concatenations of the replay's inputs (reference: the same arithmetic on the ranks'
  known inputs).
- A DP=2 tiny Qwen3-MoE with micro-batch overlap (DBO) and FULL_DECODE_ONLY graphs in
  float16: every token is transformers' float32 argmax given the run's tokens before it,
  within ``TIE_TOLERANCE`` in logit (``test_npu_sim_engine``'s check); each rank captures
  micro-batched graphs and replays them with per-micro-batch task updates, the MoE's
  all-gathers and reduce-scatters run through the NPU communicator, in graphs too, and no
  step that replays a graph synchronizes.
- By hand (``NPU_SIM_BY_HAND=1``; minutes each on 2 cores, see the README): TP=2 on the
  tiny Llama, MLA with DCP=2 (TP=2) on a tiny DeepSeek-shaped model, both FULL_DECODE_ONLY.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests-integration"))


BY_HAND = pytest.mark.skipif(
    os.environ.get("NPU_SIM_BY_HAND") != "1", reason="minutes on 2 cores: NPU_SIM_BY_HAND=1"
)
TIMEOUT_S = 1200
DBO_ARGS = [
    "--data-parallel-size", "2", "--enable-dbo",
    "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "4",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the NPU communicator in a simulated graph --------------------------------------
SIZES = [2, 3]  # rows each rank brings to the variable-size collectives
WIDTH = 4


def _rank_rows(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s rows at ``step``: every value ``100 * step + 10 * rank + row``."""
    rows = torch.arange(SIZES[rank], dtype=torch.float16)[:, None].expand(-1, WIDTH)
    return rows + 100 * step + 10 * rank


def _communicator_rank(rank: int, port: int, wheel_dir: str, results) -> None:
    import torch.distributed as dist
    from stand_in_install import installed_stand_in
    from torch_npu_schemas import download_wheel, read_wheel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    api = read_wheel(download_wheel(Path(wheel_dir)))
    with installed_stand_in(api):
        from npu_vllm_bridge.worker.npu_communicator import NPUCommunicator

        group = dist.group.WORLD
        communicator = NPUCommunicator(cpu_group=group, device_group=group)
        mine = _rank_rows(rank, step=0)
        everyone = torch.zeros(sum(SIZES), WIDTH, dtype=torch.float16)
        graph, stream = torch.npu.NPUGraph(), torch.npu.Stream()
        with torch.npu.graph(graph, stream=stream):
            gathered = communicator.all_gatherv(mine * 1, dim=0, sizes=SIZES)
            scattered = communicator.reduce_scatterv(everyone * 1, dim=0, sizes=SIZES)
            summed = communicator.all_reduce(mine[: min(SIZES)] * 1)
        replays = []
        for step in (1, 2):
            mine.copy_(_rank_rows(rank, step))
            everyone.copy_(torch.cat([_rank_rows(r, step) for r in range(2)]))
            graph.replay()
            replays.append([t.tolist() for t in (gathered, scattered, summed)])
        results.put((rank, replays, torch.npu.runtime.stats["captured_collectives"]))
    dist.destroy_process_group()


def test_npu_communicator_collectives_replay_in_a_simulated_graph(torch_npu_api):
    """Captured once on step 0's inputs, replayed on steps 1 and 2: each replay's
    collectives read that step's inputs."""
    from npu_sim_install import wheel_dir  # where the fixture has the wheel

    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), _free_port()
    ranks = [
        context.Process(target=_communicator_rank, args=(rank, port, str(wheel_dir()), results))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        answers = dict((rank, rest) for rank, *rest in (results.get(timeout=300) for _ in ranks))
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    for rank, (replays, captured) in answers.items():
        assert captured == 3, f"rank {rank}: {captured} collectives captured"
        for step, answers_of_step in zip((1, 2), replays):
            gathered, scattered, summed = (
                torch.tensor(a, dtype=torch.float16) for a in answers_of_step
            )
            both = torch.cat([_rank_rows(r, step) for r in range(2)])
            assert torch.equal(gathered, both), (rank, step, gathered)
            start = sum(SIZES[:rank])
            assert torch.equal(scattered, 2 * both[start : start + SIZES[rank]]), (rank, step)
            rows = min(SIZES)
            expected = _rank_rows(0, step)[:rows] + _rank_rows(1, step)[:rows]
            assert torch.equal(summed, expected), (rank, step, summed)
