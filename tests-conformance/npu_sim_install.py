"""The simulated Ascend NPU inside a vLLM engine in host mode (test-only).

:func:`install_simulated_npu` puts the stand-in ``torch_npu`` / ``torch.npu``
(``schema_stand_in``, ``npu_runtime_stand_in``) in place and switches the host platform
to the NPU platform's bridge settings (:data:`NPU_SETTINGS`: the ``ascend`` providers,
``planes`` KV pages, the ``npu`` graph backend, every graph captured at start-up with
the longest context). vLLM then runs the NPU path (providers, graph capture, task
updates, replays) on CPU tensors, each torch_npu call checked against the wheel's
schemas and the graph protocol enforced.

Worker processes vLLM spawns (data or context parallel ranks) get the same: with
:func:`simulation_environment` in a process's environment, ``npu_sim_site``'s
``sitecustomize`` installs the simulation as the bridge's host platform module is
imported. Nothing in the packages imports this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.abc
import importlib.util
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SITE_DIR = HERE / "npu_sim_site"  # holds the sitecustomize of simulated processes
SIM_ENV = "NPU_SIM"  # "1": each process of the run simulates the NPU
FAULT_ENV = "NPU_SIM_FAULT"  # a deliberate fault of npu_sim_faults, for the tests
WHEEL_DIR_ENV = "TORCH_NPU_WHEEL_DIR"
DEFAULT_WHEEL_DIR = HERE.parent / ".pytest_cache" / "d" / "torch-npu-wheel"  # pytest's cache
HOST_PLATFORM_MODULE = "npu_vllm_bridge.host.platform"
HOST_WORKER_MODULE = "npu_vllm_bridge.host.worker"
HOST_RUNNER_V2_MODULE = "npu_vllm_bridge.host.runner_v2"
NPU_COMMUNICATOR_MODULE = "npu_vllm_bridge.worker.npu_communicator"
# The NPU platform's device communicator (platforms/npu.py's NPU_COMMUNICATOR), which
# that module cannot be imported to read without an NPU.
NPU_COMMUNICATOR = f"{NPU_COMMUNICATOR_MODULE}.NPUCommunicator"
# Its collectives the report counts, as vLLM's process groups call them.
COMMUNICATOR_CALLS = (
    "all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv",
    "dispatch", "combine",
)  # fmt: skip


@functools.cache
def npu_settings() -> Any:
    """The NPU platform's bridge settings, as the simulated host platform takes them."""
    from npu_vllm_bridge.settings import BridgeSettings

    return BridgeSettings(
        attention_provider="ascend",
        kv_cache_split="planes",
        graph_backend="npu",
        capture_longest_context=True,
        capture_on_first_use=False,
    )


@dataclasses.dataclass
class Simulation:
    """The stand-in ``torch_npu`` module of this process and its runtime."""

    module: Any
    step_syncs: Counter = dataclasses.field(default_factory=Counter)
    communicator_calls: Counter = dataclasses.field(default_factory=Counter)

    @property
    def runtime(self) -> Any:
        return self.module.npu.runtime

    def report(self) -> dict[str, Any]:
        """Counters of this process: graphs, replays, task updates, synchronizes inside
        replayed steps, collectives captured and replayed in graphs, calls of the NPU
        communicator's collectives, torch_npu calls by op name (and torch.npu calls by
        name)."""
        stats, counts = self.runtime.stats, self.module.log.counts
        return {
            "graphs_captured": stats["captures"],
            "replays": stats["replays"],
            "task_updates": stats["task_updates"],
            "synchronizes": self.step_syncs["in_replayed_steps"],
            "synchronizes_total": stats["synchronizes"],
            "event_synchronizes": stats["event_synchronizes"],
            "replayed_ops": stats["replayed_ops"],
            "streams_held": sum(g.streams for g in self.runtime.graphs if g.captured),
            "captured_collectives": stats["captured_collectives"],
            "replayed_collectives": stats["replayed_collectives"],
            "communicator_calls": dict(sorted(self.communicator_calls.items())),
            "torch_npu_calls": dict(
                sorted((k, v) for k, v in counts.items() if not k.startswith("torch.npu."))
            ),
            "quantized_kv_calls": dict(sorted(self.module.log.quantized.items())),
            "torch_npu_runtime_calls": dict(
                sorted((k, v) for k, v in counts.items() if k.startswith("torch.npu."))
            ),
        }


_SIMULATION: Simulation | None = None


def wheel_dir() -> Path:
    """Where the torch-npu wheel is kept: ``$TORCH_NPU_WHEEL_DIR``, else pytest's cache
    folder the conformance tests use."""
    configured = os.environ.get(WHEEL_DIR_ENV)
    return Path(configured) if configured else DEFAULT_WHEEL_DIR


def install_simulated_npu() -> Simulation:
    """Install the simulation in this process (once); returns it."""
    global _SIMULATION
    if _SIMULATION is not None:
        return _SIMULATION
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from schema_stand_in import CallLog
    from stand_in_install import install_stand_in
    from torch_npu_schemas import download_wheel, read_wheel

    from npu_attention import register_provider
    from npu_vllm_bridge.host.platform import HostPlatform

    folder = wheel_dir()
    folder.mkdir(parents=True, exist_ok=True)
    api = read_wheel(download_wheel(folder))
    module = install_stand_in(api, CallLog(keep=False))  # counts only: no tensors held
    # The ascend providers as they are, but taking the CPU tensors of the simulation.
    register_provider("ascend", "ascend_cases:HostAscendProvider")
    register_provider("ascend", "ascend_mla_cases:HostAscendMLAProvider", family="mla")
    HostPlatform.bridge_settings = npu_settings()
    # vLLM's process groups talk through the NPU platform's communicator (over gloo).
    HostPlatform.get_device_communicator_cls = classmethod(lambda cls: NPU_COMMUNICATOR)
    _SIMULATION = Simulation(module)
    # These modules import much of vLLM: patched once vLLM loads them (importing them
    # here, inside vLLM's own import of the platform, would be circular).
    after_import(HOST_WORKER_MODULE, lambda: _instrument_worker(_SIMULATION))
    after_import(NPU_COMMUNICATOR_MODULE, lambda: _count_communicator_calls(_SIMULATION))
    after_import(HOST_RUNNER_V2_MODULE, lambda: _host_work_unrecorded(_SIMULATION))
    fault = os.environ.get(FAULT_ENV)
    if fault:
        from npu_sim_faults import install_fault

        install_fault(fault, _SIMULATION.runtime)
    return _SIMULATION


def _instrument_worker(simulation: Simulation) -> None:
    """The host worker counts synchronizes in replayed steps and answers
    ``collective_rpc("npu_sim_report")`` with this process's report, its DP rank and
    rank (so a run collects the report of every worker process)."""
    from npu_vllm_bridge.host.worker import HostWorker

    def npu_sim_report(self) -> dict[str, Any]:
        report = simulation.report()
        report.update(
            dp_rank=self.parallel_config.data_parallel_rank,
            rank=self.rank,
            model_runner=type(self.model_runner).__name__,
        )
        return report

    HostWorker.npu_sim_report = npu_sim_report
    _count_step_synchronizes(simulation)


def _host_work_unrecorded(simulation: Simulation) -> None:
    """Host-side work that host mode keeps out of its host graphs (vLLM's DP metadata in
    a V2 capture) stays out of the stand-in's captures too: every tensor of the
    simulation is a CPU tensor, so the stand-in records what an ``NPUGraph`` leaves to
    the host."""
    from npu_vllm_bridge.host import runner_v2

    host_only = runner_v2.unrecorded_host_work

    @contextlib.contextmanager
    def unrecorded() -> Iterator[None]:
        with host_only(), simulation.runtime.unrecorded():
            yield

    runner_v2.unrecorded_host_work = unrecorded


def _count_communicator_calls(simulation: Simulation) -> None:
    """Count the calls of the NPU communicator's collectives (:data:`COMMUNICATOR_CALLS`)."""
    from npu_vllm_bridge.worker.npu_communicator import NPUCommunicator

    def counted(name: str, method: Any) -> Any:
        @functools.wraps(method)
        def call(self, *args: Any, **kwargs: Any) -> Any:
            simulation.communicator_calls[name] += 1
            return method(self, *args, **kwargs)

        return call

    for name in COMMUNICATOR_CALLS:
        setattr(NPUCommunicator, name, counted(name, getattr(NPUCommunicator, name)))


def _count_step_synchronizes(simulation: Simulation) -> None:
    """Count the synchronizes issued in steps that replay a graph: those of a worker's
    ``execute_model`` that launched a replay, and of the ``sample_tokens`` after it."""
    from npu_vllm_bridge.host.worker import HostWorker

    stats, syncs = simulation.runtime.stats, simulation.step_syncs
    execute_model, sample_tokens = HostWorker.execute_model, HostWorker.sample_tokens

    def counted_execute_model(self, *args: Any, **kwargs: Any) -> Any:
        replays, before = stats["replays"], stats["synchronizes"]
        try:
            return execute_model(self, *args, **kwargs)
        finally:
            syncs["replayed"] = stats["replays"] > replays
            if syncs["replayed"]:
                syncs["in_replayed_steps"] += stats["synchronizes"] - before

    def counted_sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        before = stats["synchronizes"]
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            if syncs["replayed"]:
                syncs["in_replayed_steps"] += stats["synchronizes"] - before

    HostWorker.execute_model = counted_execute_model
    HostWorker.sample_tokens = counted_sample_tokens


def simulation_environment(
    environ: dict[str, str] | None = None, fault: str | None = None
) -> dict[str, str]:
    """``environ`` (default: this process's) with what makes a Python process simulate
    the NPU: host mode, ``NPU_SIM=1`` and ``npu_sim_site`` on ``PYTHONPATH``; ``fault``
    names a deliberate fault of ``npu_sim_faults`` to install with it."""
    env = dict(os.environ if environ is None else environ)
    if fault is not None:
        env[FAULT_ENV] = fault
    paths = [str(SITE_DIR), str(HERE), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        {
            SIM_ENV: "1",
            "NPU_BRIDGE_DEVICE": "cpu",
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
            WHEEL_DIR_ENV: str(wheel_dir()),
        }
    )
    return env


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then()`` once the module ``name`` has loaded."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module: Any) -> None:
            exec_module(module)
            then()

        spec.loader.exec_module = exec_then
        return spec


def after_import(name: str, then: Any) -> None:
    """``then()`` now if the module ``name`` is loaded, else right after it loads."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def install_on_host_platform_import() -> None:
    """Install the simulation in this process when vLLM loads the host platform."""
    after_import(HOST_PLATFORM_MODULE, install_simulated_npu)
