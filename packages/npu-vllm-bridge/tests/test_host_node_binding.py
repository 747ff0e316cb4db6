"""The host platform's default OpenMP binding, per node, through vLLM's own slicing.

vLLM's engine arguments build each node's configuration (as ``vllm serve`` with
``--nnodes``/``--node-rank``, the followers ``--headless``); the bridge's default binding
goes into the environment; vLLM's ``OMPProcessManager`` (what its multiprocess executor
uses to start the CPU workers) turns it into each local worker's CPU list. On a
simulated node of 8 CPUs and one NUMA node, the workers of a node must get disjoint
CPU lists that, with the CPUs vLLM reserves for its own processes, are all the node's
CPUs.
"""

from __future__ import annotations

import os

import pytest
import vllm.utils.cpu_resource_utils as cpu_utils
from tiny_configs import write_config
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.cpu_resource_utils import LogicalCPUInfo
from vllm.utils.ompmultiprocessing import OMPProcessManager

from npu_vllm_bridge.host import platform as host_platform

NODE_CPUS = list(range(8))


@pytest.fixture
def eight_cpu_node(monkeypatch):
    """This process sees one NUMA node of 8 CPUs, each its own physical core; the
    binding variable is unset."""
    cpus = [LogicalCPUInfo(id=cpu, physical_core=cpu, numa_node=0) for cpu in NODE_CPUS]
    monkeypatch.setattr(cpu_utils, "get_allowed_cpu_list", lambda: cpus)
    monkeypatch.setattr(cpu_utils, "get_visible_memory_node", lambda *args: [0])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(NODE_CPUS))
    monkeypatch.delenv(host_platform.OMP_THREADS_BIND, raising=False)


# vLLM keeps offline data parallelism for MoE models only.
TINY_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
)


def _node_config(tmp_path, model: dict | None = None, **parallel):
    headless = parallel.get("node_rank", 0) > 0
    args = EngineArgs(
        model=write_config(tmp_path / "model", **(model or {})),
        skip_tokenizer_init=True,
        master_addr="127.0.0.1",
        **parallel,
    )
    return args.create_engine_config(headless=headless)


def _workers_cpus(config, local_dp_ranks: range) -> tuple[list[list[int]], list[int]]:
    """Every local worker's CPU list, as vLLM's executor gives them for each local DP
    rank (the engine core sets ``data_parallel_rank_local`` before starting its
    workers), and the CPUs vLLM reserves."""
    workers, reserved = [], set()
    for local_dp_rank in local_dp_ranks:
        if config.parallel_config.data_parallel_size > 1:
            config.parallel_config.data_parallel_rank_local = local_dp_rank
        manager = OMPProcessManager(config)
        workers += manager.cpu_lists
        reserved |= set(manager.reserved_cpu_list)
    return workers, sorted(reserved)


def _assert_node_shared_out(workers: list[list[int]], reserved: list[int], count: int) -> None:
    assert len(workers) == count, workers
    taken = [cpu for cpus in workers for cpu in cpus] + reserved
    assert sorted(taken) == NODE_CPUS, f"workers {workers}, reserved {reserved}"


@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size"])
@pytest.mark.parametrize("node_rank", [0, 1])
def test_two_nodes_of_one_rank_each(eight_cpu_node, tmp_path, layout, node_rank):
    """Each node's one worker gets its node's CPUs (vLLM's ``auto`` binding, which
    one NUMA node serves for one rank), not the first half of them."""
    config = _node_config(tmp_path, **{layout: 2}, nnodes=2, node_rank=node_rank)
    parallel = config.parallel_config
    assert parallel.world_size_across_dp == 2  # what the binding was sized by before
    assert host_platform.ranks_on_this_node(parallel) == 1
    host_platform._default_omp_threads_bind(host_platform.ranks_on_this_node(parallel))
    assert host_platform.OMP_THREADS_BIND not in os.environ
    workers, reserved = _workers_cpus(config, range(1))
    _assert_node_shared_out(workers, reserved, count=1)


def test_one_node_of_two_ranks(eight_cpu_node, tmp_path):
    """Two workers on one NUMA node: the bridge's default gives each half."""
    config = _node_config(tmp_path, tensor_parallel_size=2)
    assert host_platform.ranks_on_this_node(config.parallel_config) == 2
    host_platform._default_omp_threads_bind(
        host_platform.ranks_on_this_node(config.parallel_config)
    )
    assert os.environ[host_platform.OMP_THREADS_BIND] == "0,1,2,3|4,5,6,7"
    workers, reserved = _workers_cpus(config, range(1))
    _assert_node_shared_out(workers, reserved, count=2)
    assert workers == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_one_node_of_two_data_parallel_replicas(eight_cpu_node, tmp_path):
    """DP=2 x TP=2 served from one node: four workers, each local DP rank's two take
    their own entries of the list."""
    config = _node_config(tmp_path, tensor_parallel_size=2, data_parallel_size=2)
    assert host_platform.ranks_on_this_node(config.parallel_config) == 4
    host_platform._default_omp_threads_bind(
        host_platform.ranks_on_this_node(config.parallel_config)
    )
    workers, reserved = _workers_cpus(config, range(2))
    _assert_node_shared_out(workers, reserved, count=4)


def test_offline_data_parallel_counts_every_rank(eight_cpu_node, tmp_path, monkeypatch):
    """vLLM's offline DP (``VLLM_DP_*``): each rank's process takes its local DP rank's
    entries; two such processes on one node get disjoint halves."""
    workers, reserved = [], []
    for rank in range(2):
        monkeypatch.setenv("VLLM_DP_SIZE", "2")
        monkeypatch.setenv("VLLM_DP_RANK", str(rank))
        monkeypatch.setenv("VLLM_DP_RANK_LOCAL", str(rank))
        monkeypatch.delenv(host_platform.OMP_THREADS_BIND, raising=False)
        config = _node_config(tmp_path, TINY_MOE)
        assert host_platform.ranks_on_this_node(config.parallel_config) == 2
        host_platform._default_omp_threads_bind(
            host_platform.ranks_on_this_node(config.parallel_config)
        )
        manager = OMPProcessManager(config)
        workers += manager.cpu_lists
        reserved += manager.reserved_cpu_list
    _assert_node_shared_out(workers, reserved, count=2)
