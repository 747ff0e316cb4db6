"""Deliberate faults for the simulated NPU (``npu_sim.py --fault NAME``), one mistake
each, which the simulation must catch in a vLLM engine:

- ``copy_in_task``: the ascend provider copies its key inside the attention task (a
  ``.clone()`` before the KV write, as a ``.contiguous()`` on a strided view does);
- ``skip_task_update``: the graph wrapper replays without updating the attention tasks;
- ``moved_tensor``: the ascend provider hands the fused op a block table copied at each
  step's planning, so a task update passes a tensor at another address than its capture's;
- ``sync_while_replay_waits``: the npu backend synchronizes the device after launching a
  replay, before the update that releases it;
- ``stream_budget``: the device offers 4 streams to graphs (a graph of the two-layer
  model holds 3), so the second capture goes over the budget.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from ascend_cases import HostAscendProvider

from npu_attention import register_provider


class CopyInTaskProvider(HostAscendProvider):
    """Copies ``key`` inside its task before the KV write."""

    def write_kv(self, key, value, key_cache, value_cache, plan) -> None:
        super().write_kv(key.clone(), value, key_cache, value_cache, plan)


class MovedBlockTableProvider(HostAscendProvider):
    """Plans each step's block table into a new tensor (another address every step)."""

    def prepare(self, plan: Any) -> Any:
        data = super().prepare(plan)
        return dataclasses.replace(data, block_table=data.block_table.clone())


def _copy_in_task(runtime: Any) -> None:
    register_provider("ascend", "npu_sim_faults:CopyInTaskProvider")


def _moved_tensor(runtime: Any) -> None:
    register_provider("ascend", "npu_sim_faults:MovedBlockTableProvider")


def _skip_task_update(runtime: Any) -> None:
    from npu_graphs.tasks import TaskRegistry

    TaskRegistry.update = lambda self, *args, **kwargs: None


def _sync_while_replay_waits(runtime: Any) -> None:
    from npu_graphs.backends.npu import NpuGraphBackend

    update_after_replay = NpuGraphBackend.update_tasks_after_replay

    def synchronizing_update(self, graph: Any, updates: Any) -> None:
        torch.npu.synchronize()
        update_after_replay(self, graph, updates)

    NpuGraphBackend.update_tasks_after_replay = synchronizing_update


def _stream_budget(runtime: Any) -> None:
    runtime.stream_budget = 4


FAULTS = {
    "copy_in_task": _copy_in_task,
    "skip_task_update": _skip_task_update,
    "moved_tensor": _moved_tensor,
    "sync_while_replay_waits": _sync_while_replay_waits,
    "stream_budget": _stream_budget,
}


def install_fault(name: str, runtime: Any) -> None:
    """Install the fault ``name`` of :data:`FAULTS` into this process."""
    fault = FAULTS.get(name)
    if fault is None:
        raise ValueError(f"unknown fault {name!r}; expected one of {sorted(FAULTS)}")
    fault(runtime)
