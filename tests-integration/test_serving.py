"""vLLM's OpenAI-compatible server in host mode, graphs on, on SmolLM2-135M-Instruct.

The server is started as a user would (``servers.py``), with vLLM's default graph mode
and ``max_model_len=2048``. Sixteen chat requests arrive at once; then bad ones (a prompt
longer than ``max_model_len``, negative ``max_tokens``, malformed JSON) must get HTTP
400; then the same sixteen again. Every answer must equal, token for token, the answer
of vLLM's own CPU backend (CPU_ATTN, checked equal to transformers' by the
``smollm2_chat`` fixture).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from chat_prompts import MAX_TOKENS, QUESTIONS, messages
from engines import REAL_MODEL_ENGINE
from servers import Server, serve

CONCURRENT_QUESTIONS = QUESTIONS * 2  # max_num_seqs requests in flight at once


def _chat(server: Server, content: str, max_tokens: int = MAX_TOKENS) -> tuple[int, dict]:
    body = {
        "model": server.model,
        "messages": messages(content),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    return server.post("/v1/chat/completions", json.dumps(body).encode())


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    args = [
        "--dtype", "float32",
        "--max-model-len", str(REAL_MODEL_ENGINE["max_model_len"]),
        "--max-num-seqs", str(REAL_MODEL_ENGINE["max_num_seqs"]),
        "--gpu-memory-utilization", "0.2",
        "--seed", "0",
    ]  # fmt: skip
    with serve(smollm2, args, tmp_path_factory.mktemp("server") / "server.log") as running:
        yield running


def _answer_all(server: Server) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=len(CONCURRENT_QUESTIONS)) as pool:
        replies = list(pool.map(lambda question: _chat(server, question), CONCURRENT_QUESTIONS))
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
    status, reply = _chat(server, too_long)
    assert status == 400, reply
    assert "maximum context length" in json.dumps(reply) or "max_model_len" in json.dumps(reply)
    status, reply = _chat(server, QUESTIONS[0], max_tokens=-1)
    assert status == 400 and "max_tokens" in json.dumps(reply), reply
    status, reply = server.post("/v1/chat/completions", b'{"model": "x", "messages": [{"role":')
    assert status == 400 and "JSON" in json.dumps(reply), reply

    after = _answer_all(server)
    assert after == before
