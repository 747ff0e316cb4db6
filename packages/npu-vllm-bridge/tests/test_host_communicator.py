"""The host and NPU communicators' variable-size collectives (data-parallel MoE) over
gloo, against the same rows put together in one process. The NPU communicator's
primitives are torch.distributed's equal-sized tensor collectives, which HCCL serves on
the NPU and gloo here."""

from __future__ import annotations

import socket

import pytest
import torch
from communicator_ranks import SIZES, communicator_rank, rank_rows


def _run_ranks(kind: str) -> dict[int, list]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=communicator_rank, args=(r, port, queue, kind)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("kind", ["host", "npu"])
def test_all_gatherv_and_reduce_scatterv_over_gloo_equal_the_rows_put_together(kind):
    results = _run_ranks(kind)
    rows = torch.cat([rank_rows(r, n) for r, n in enumerate(SIZES)])
    summed = sum(rank_rows(r, sum(SIZES)) * (r + 1) for r in range(2))
    starts = [0, SIZES[0]]
    for rank in range(2):
        gathered, gathered_t, scattered, equal = (torch.from_numpy(a) for a in results[rank])
        torch.testing.assert_close(gathered, rows, rtol=0, atol=0)
        torch.testing.assert_close(gathered_t, rows.t(), rtol=0, atol=0)
        mine = summed[starts[rank] : starts[rank] + SIZES[rank]]
        torch.testing.assert_close(scattered, mine, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(equal, torch.cat([rank_rows(r, 2) for r in range(2)]))


def test_sizes_that_do_not_fit_are_refused():
    from types import SimpleNamespace

    from npu_vllm_bridge.host.communicator import HostCommunicator

    comm = SimpleNamespace(world_size=2, rank_in_group=0)
    check = HostCommunicator._checked_sizes
    with pytest.raises(ValueError, match=r"give 2 ranks' row counts, got \[1\]"):
        check(comm, [1], 1, total=False)
    with pytest.raises(ValueError, match="expected 2 rows along the collective's dim, got 3"):
        check(comm, [2, 5], 3, total=False)
    with pytest.raises(ValueError, match="expected 7 rows along the collective's dim, got 6"):
        check(comm, [2, 5], 6, total=True)
    with pytest.raises(ValueError, match="5 rows do not split into 2 equal parts"):
        check(comm, None, 5, total=True)
    assert check(comm, None, 6, total=True) == [3, 3]


def test_the_npu_platform_names_the_npu_communicator():
    """The platform module needs torch_npu; its communicator's name is read from source."""
    import ast
    import importlib.util
    from pathlib import Path

    from npu_vllm_bridge.worker.npu_communicator import NPUCommunicator

    path = Path(importlib.util.find_spec("npu_vllm_bridge.platforms").origin).parent / "npu.py"
    names = {
        node.targets[0].id: node.value.value
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
    }
    module, name = names["NPU_COMMUNICATOR"].rsplit(".", 1)
    assert (module, name) == (NPUCommunicator.__module__, NPUCommunicator.__name__)


def test_the_npu_communicator_runs_vllms_moe_dispatch_through_its_all2all_manager():
    from types import SimpleNamespace

    from npu_vllm_bridge.worker.npu_communicator import NPUCommunicator

    comm = NPUCommunicator.__new__(NPUCommunicator)
    comm.use_all2all, comm.all2all_backend = True, "deepep_low_latency"
    with pytest.raises(ValueError, match="allgather_reducescatter"):
        comm.init_all2all_manager()
    calls = []
    comm.all2all_manager = SimpleNamespace(combine=lambda *args: calls.append(args) or "combined")
    assert comm.combine("hidden", False) == "combined" and calls == [("hidden", False)]
    comm.all2all_manager = None  # a group without all-to-all: vLLM's base, a no-op
    assert comm.combine("hidden") == "hidden"
