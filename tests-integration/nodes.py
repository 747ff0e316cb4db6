"""Two vLLM "nodes" on 127.0.0.1, started as a user starts a multi-node server, for the
tests: a leader that serves the OpenAI API and a headless follower, each
``python -m npu_vllm_bridge.serve`` (vLLM's ``serve`` subcommand) in host mode with
``--nnodes 2``, the master address and port, and ``VLLM_HOST_IP``. Each is its own
process group, stopped by the group's id; what each node logged and the process
groups that must be empty afterwards come back to the test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from servers import Server, _wait_until_healthy, free_port

LOOPBACK = "127.0.0.1"
# How long a node may take to stop on SIGTERM. A follower's worker waits in a collective
# for its gone peers: vLLM's executor waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS for it,
# then SIGTERM, 4 s, SIGKILL.
STOP_TIMEOUT_S = 30
WORKER_SHUTDOWN_TIMEOUT_S = "1"

_BINDING = re.compile(
    r"VLLM_CPU_OMP_THREADS_BIND='(?P<mask>[^']*)'.*?local_world_size=(?P<local>\d+).*?"
    r"(?P<ranks>(?:local_rank=\d+, core ids=\[[\d, ]*\].*?)*)reserved_cpus=\[(?P<reserved>[\d, ]*)\]",
    re.S,
)
_RANK = re.compile(r"local_rank=(\d+), core ids=\[([\d, ]*)\]")


@dataclass
class Binding:
    """vLLM's OpenMP binding as one node logged it: the variable's value, the node's
    worker count, each local rank's CPUs and the CPUs vLLM reserved for its own
    processes."""

    mask: str
    local_world_size: int
    ranks: dict[int, list[int]]
    reserved: list[int]


@dataclass
class Nodes:
    """The running leader (its API), both nodes' logs and process groups, and once
    stopped, what was still alive in them after SIGTERM (killed then)."""

    server: Server
    logs: list[Path]
    groups: list[int]
    left_after_sigterm: list[str] | None = None


def _ids(text: str) -> list[int]:
    return [int(cpu) for cpu in text.replace(" ", "").split(",") if cpu]


def logged_binding(log: Path) -> Binding:
    """The binding vLLM's executor logged in ``log`` (it logs one per node)."""
    found = list(_BINDING.finditer(log.read_text(errors="replace")))
    assert len(found) == 1, f"{len(found)} binding reports in {log}"
    match = found[0]
    ranks = {int(rank): _ids(cpus) for rank, cpus in _RANK.findall(match["ranks"])}
    return Binding(match["mask"], int(match["local"]), ranks, _ids(match["reserved"]))


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("wb") as log_file:
        return subprocess.Popen(
            command,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as one
        )


@contextmanager
def serve_two_nodes(
    model: Path,
    args: list[str],
    directory: Path,
    env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
) -> Iterator[Nodes]:
    """Serve ``model`` from two nodes of this host with more ``vllm serve`` ``args``
    (the parallel layout and the rest), more environment ``env`` and the variables
    ``unset`` removed from it; node ``r`` logs to
    ``directory/node<r>.log``. Yields once the leader's ``/health`` answers; stops both
    process groups on exit."""
    master_port, port = free_port(), free_port()
    common = [
        sys.executable, "-m", "npu_vllm_bridge.serve", str(model), *args,
        "--nnodes", "2", "--master-addr", LOOPBACK, "--master-port", str(master_port),
    ]  # fmt: skip
    roles = [
        ["--node-rank", "0", "--host", LOOPBACK, "--port", str(port)],
        ["--node-rank", "1", "--headless"],
    ]
    environment = dict(
        os.environ,
        NPU_BRIDGE_DEVICE="cpu",
        VLLM_HOST_IP=LOOPBACK,
        VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=WORKER_SHUTDOWN_TIMEOUT_S,
        **(env or {}),
    )
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", *unset):  # served as users run it
        environment.pop(name, None)
    logs = [directory / f"node{rank}.log" for rank in range(len(roles))]
    procs: list[subprocess.Popen] = []
    nodes = None
    try:
        for role, log in zip(roles, logs):
            procs.append(_start(common + role, environment, log))
        server = Server(f"http://{LOOPBACK}:{port}", str(model), logs[0])
        _wait_until_healthy(procs[0], server)
        assert procs[1].poll() is None, f"follower exited:\n{logs[1].read_text()[-6000:]}"
        nodes = Nodes(server, logs, [proc.pid for proc in procs])
        yield nodes
    finally:
        left = stop_all(procs)
        if nodes is not None:
            nodes.left_after_sigterm = left


def stop_all(procs: list[subprocess.Popen]) -> list[str]:
    """SIGTERM every node's process group at once, as a user stops each node; wait up to
    ``STOP_TIMEOUT_S`` for the groups to empty, then SIGKILL what is left and reap the
    nodes' main processes. Returns what was left after SIGTERM (``live_members``)."""
    for proc in procs:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    left = [member for proc in procs for member in live_members(proc.pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        for proc in procs:
            proc.poll()  # reap a main process that has exited
        left = [member for proc in procs for member in live_members(proc.pid)]
    for proc in procs:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)
    return left


def live_members(group: int) -> list[str]:
    """The processes of process group ``group`` that are not zombies: ``pid state
    command`` for each."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, _, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == group and state != "Z":
            members.append(f"{entry.name} {state} {stat[: stat.rindex(')') + 1]}")
    return members
