"""The NPU platform's multi-node settings, run through the vLLM code that consumes them.

On a machine without an NPU (the platform is loaded with a stand-in ``torch_npu``, as in
``test_npu_platform_config.py``), with the NPU platform as vLLM's current platform:

- visible devices: vLLM's data-parallel launcher takes each local DP rank's devices
  from ``device_control_env_var`` (``ASCEND_RT_VISIBLE_DEVICES``, the variable the
  Ascend runtime reads and Ray's ``NPUAcceleratorManager`` sets), never from
  ``CUDA_VISIBLE_DEVICES``, and maps a worker's logical device to its visible ordinal;
- Ray's device key: vLLM's Ray executor finds a placement group's devices by
  ``ray_device_key``, which must be the resource Ray gives Ascend NPUs, ``"NPU"``
  (Ray's ``NPUAcceleratorManager.get_resource_name()``). Ray is not installed here: the
  placement group and node table are the data Ray would return;
- distributed backend: vLLM's process groups name their device backend
  ``<device>:<backend>`` from the platform, ``npu:hccl``, the pair torch_npu registers
  with ``torch.distributed``.
"""

from __future__ import annotations

import types

import pytest
import vllm.platforms
import vllm.platforms.interface as platform_interface
from test_npu_platform_config import npu_platform  # noqa: F401  (fixture)
from vllm.config import ParallelConfig


@pytest.fixture
def npu_current(npu_platform, monkeypatch):  # noqa: F811
    """The NPU platform as vLLM's current platform, every module's view of it."""
    platform = npu_platform()
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
    monkeypatch.setattr(platform_interface, "_assigned_physical_gpu_ids", None)
    return platform


def _vllm_config(**parallel) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        parallel_config=ParallelConfig(distributed_executor_backend="mp", **parallel)
    )


def test_data_parallel_ranks_take_their_devices_from_ascend_visible_devices(
    npu_current, monkeypatch
):
    from vllm.v1.engine import utils as engine_utils

    monkeypatch.setattr(engine_utils, "current_platform", npu_current)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    config = _vllm_config(tensor_parallel_size=2)
    engine_utils.set_assigned_physical_gpu_ids_for_dp_rank(config, local_dp_rank=1)
    assert config.parallel_config.assigned_physical_gpu_ids == [6, 7]
    # The worker of local rank 1 in that replica opens the 4th visible device.
    platform_interface.set_assigned_physical_gpu_ids([6, 7])
    assert npu_current.logical_device_id_to_visible_device_id(1) == 3


def test_node_of_a_multi_node_replica_takes_its_first_devices(npu_current, monkeypatch):
    """TP=16 over two nodes of 8 NPUs: each node's workers are its 8 visible devices."""
    from vllm.v1.engine import utils as engine_utils

    monkeypatch.setattr(engine_utils, "current_platform", npu_current)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", ",".join(map(str, range(8))))
    config = _vllm_config(tensor_parallel_size=16, nnodes=2, node_rank=1)
    assert config.parallel_config.local_world_size == 8
    engine_utils.set_assigned_physical_gpu_ids_for_dp_rank(config, local_dp_rank=0)
    assert config.parallel_config.assigned_physical_gpu_ids == list(range(8))


def _ray_cluster(monkeypatch, ray_utils, bundles, bundle_nodes, driver):
    """Ray's view of a placement group of ``bundles`` placed on ``bundle_nodes``."""
    nodes = sorted(set(bundle_nodes))
    ray = types.SimpleNamespace(
        nodes=lambda: [
            {"NodeID": node, "NodeManagerAddress": f"10.0.0.{i}", "Alive": True}
            for i, node in enumerate(nodes)
        ],
        get_runtime_context=lambda: types.SimpleNamespace(get_node_id=lambda: driver),
    )
    table = {"bundles_to_node_id": dict(enumerate(bundle_nodes))}
    monkeypatch.setattr(ray_utils, "ray", ray, raising=False)
    monkeypatch.setattr(ray_utils, "placement_group_table", lambda pg: table, raising=False)
    return types.SimpleNamespace(bundle_specs=bundles)


def test_ray_executor_finds_the_npu_bundles(npu_current, monkeypatch):
    """A placement group of four NPUs on two nodes and a CPU-only bundle: vLLM's Ray
    executor places a worker on each NPU bundle, the driver's node first."""
    from vllm.v1.executor import ray_utils

    monkeypatch.setattr(ray_utils, "current_platform", npu_current)
    assert npu_current.ray_device_key == "NPU"
    group = _ray_cluster(
        monkeypatch,
        ray_utils,
        bundles=[{"NPU": 1.0}, {"NPU": 1.0}, {"NPU": 1.0}, {"NPU": 1.0}, {"CPU": 1.0}],
        bundle_nodes=["node-b", "node-a", "node-b", "node-a", "node-a"],
        driver="node-a",
    )
    placed = ray_utils.get_bundles_sorted_by_node(group)
    assert [(index, node) for index, node, _ in placed] == [
        (1, "node-a"),
        (3, "node-a"),
        (0, "node-b"),
        (2, "node-b"),
    ]


def test_device_backend_is_npu_hccl(npu_current):
    from vllm.distributed import parallel_state

    assert npu_current.is_out_of_tree()
    assert parallel_state._device_backend_str(npu_current.dist_backend) == "npu:hccl"
