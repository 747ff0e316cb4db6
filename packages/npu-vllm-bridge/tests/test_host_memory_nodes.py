"""The host platform's NUMA memory node of each data-parallel rank.

vLLM 0.33 assigns DP rank ``r`` the "device" ``device_id_to_physical_device_id(r)``
(``vllm.v1.engine.utils.get_physical_gpu_ids_for_local_dp_rank``), and its CPU worker
binds memory to that node among the nodes the process may use; rank 1 on a one-node
host found none (``IndexError``). Reference: vLLM's own rank-to-device computation and
its visible-node filter, on a simulated host with the memory nodes the test names.
"""

from __future__ import annotations

import inspect

import pytest
import vllm.utils.cpu_resource_utils as cpu_utils
from vllm.v1.engine.utils import get_physical_gpu_ids_for_local_dp_rank

from npu_vllm_bridge.host import platform as host_platform
from npu_vllm_bridge.host.platform import HostPlatform

DEVICE_ENV = "CPU_VISIBLE_MEMORY_NODES"


@pytest.fixture
def memory_nodes(monkeypatch):
    """Set the memory nodes this process may use."""
    monkeypatch.delenv(DEVICE_ENV, raising=False)

    def use(nodes: list[int]) -> None:
        monkeypatch.setattr(cpu_utils, "get_memory_affinity", lambda pid=0: list(nodes))

    return use


def _rank_nodes(monkeypatch, dp_size: int) -> list[list[int]]:
    """Each DP rank's nodes as vLLM computes them with the host platform current."""
    import vllm.v1.engine.utils as engine_utils

    monkeypatch.setattr(engine_utils, "current_platform", HostPlatform())
    return [get_physical_gpu_ids_for_local_dp_rank(DEVICE_ENV, r, 1) for r in range(dp_size)]


@pytest.mark.parametrize(
    ("nodes", "dp_size", "expected"),
    [([0], 2, [[0], [0]]), ([0, 1], 3, [[0], [1], [0]]), ([0, 1], 2, [[0], [1]])],
)
def test_each_rank_gets_a_node_it_may_use(memory_nodes, monkeypatch, nodes, dp_size, expected):
    """A rank whose own node exists keeps it; the others share the usable nodes round
    robin (rank 2 on nodes [0, 1] takes node 2 % 2 = 0)."""
    memory_nodes(nodes)
    ranks = _rank_nodes(monkeypatch, dp_size)
    assert ranks == expected
    visible = inspect.signature(cpu_utils.get_visible_memory_node).parameters
    for assigned in ranks:
        # vLLM 0.33's CPU worker filters the rank's nodes by the usable ones (0.32 ignores them).
        usable = cpu_utils.get_visible_memory_node(assigned) if visible else nodes
        assert usable, f"rank nodes {assigned} leave the CPU worker no memory node"


def test_a_usable_node_is_kept(memory_nodes) -> None:
    memory_nodes([0, 2])
    assert [host_platform.shared_memory_node(n) for n in range(4)] == [0, 2, 2, 2]
