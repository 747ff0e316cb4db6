"""Micro-batch overlap (vLLM's DBO, ``enable_dbo``) in host mode, eagerly and with FULL
graphs, against one data-parallel rank without it.

Two DP ranks of a tiny random Qwen3-MoE (``dp_ranks.py``), each its own process group
stopped by id, split steps into two micro-batches from low thresholds (2 decode tokens,
4 tokens with a prefill): the prefill steps, and decode steps until fewer than two
requests are left on a rank. Prompts stop at different lengths, so decode batches
shrink (4, 3, 2 requests) and vLLM's split gives unequal halves (3 tokens: 1 + 2), and
ranks with fewer requests run padded micro-batches. The eight greedy requests (four
per rank, in flight together) must give the tokens of one rank without DBO, and each
sampled token's logprob within 1e-4 of it. Each rank must report split decode and
prefill steps, unequal ones, and hand-overs at the MoE collectives; with FULL graphs,
split decode steps replayed from one graph of both micro-batches, each micro-batch's
attention tasks updated with its own plan before each replay.

The same with FULL graphs on a tiny DeepSeek-V3-shaped MoE (MLA attention, grouped
sigmoid routing), whose one rank first matches transformers.

The same as a user serves it: a DP=2 OpenAI-compatible server with ``--enable-dbo``
(``servers.py``; the checkpoint gets a word-level tokenizer), the eight prompts sent as
concurrent completions requests, eagerly and with FULL graphs, against the same one
rank. vLLM's load balancer picks each request's rank. The workers are processes of the
server: each writes its counters to the directory ``NPU_BRIDGE_COUNTERS_DIR`` names
after every step (vLLM's utility calls answer from the first DP engine only).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from checkpoints import hf_greedy, write_word_tokenizer
from dp_ranks import PROMPTS, by_prompt, run_rank_results, write_tiny_moe
from mla_checkpoints import write_mla_moe_checkpoint
from servers import Server, serve

from npu_vllm_bridge.graphs.counters import COUNTERS_DIR_ENV

MAX_TOKENS = [12, 11, 10, 12, 9, 12, 11, 10]  # per prompt; rank r runs prompts r::2
LOGPROB_ATOL = 1e-4
DBO = {"enable_dbo": True, "dbo_decode_token_threshold": 2, "dbo_prefill_token_threshold": 4}
FULL_GRAPHS = {
    "enforce_eager": False,
    "compilation_config": {
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": [1, 2, 3, 4, 8],
    },
}
MOE_LAYERS = 2
VOCAB_SIZE = 512
SERVER_ARGS = [
    "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
    "--kv-cache-memory-bytes", str(64 * 2**20), "--seed", "0", "--no-enable-prefix-caching",
    "--data-parallel-size", "2", "--enable-dbo",
    "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "4",
]  # fmt: skip
SERVER_ROUNDS = 3  # rounds of the same requests: prefix caching is off, so each prefills
SERVER_GRAPHS = {
    "eager": ["--enforce-eager"],
    "full": ["--compilation-config", json.dumps(FULL_GRAPHS["compilation_config"])],
}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = write_tiny_moe(tmp_path_factory.mktemp("dbo") / "tiny-qwen3-moe")
    return write_word_tokenizer(path, VOCAB_SIZE)  # for the server; ranks skip it


@pytest.fixture(scope="module")
def one_rank(tiny_moe, tmp_path_factory):
    """Tokens and logprobs of every prompt from one rank, eager, no micro-batches."""
    results = run_rank_results(tiny_moe, 1, tmp_path_factory.mktemp("dp1"), max_tokens=MAX_TOKENS)
    tokens = by_prompt(results, "tokens")
    assert [len(t) for t in tokens] == MAX_TOKENS, tokens
    assert results[0]["counters"]["split_steps"] == 0
    return tokens, by_prompt(results, "logprobs")


def _check_micro_batched_ranks(
    results: list[dict], reference: tuple, graphs: str, runner: str = "v1"
) -> None:
    """Two DP ranks' ``results`` with DBO against one rank's (tokens, logprobs), and each
    rank's split steps, hand-overs and, with graphs, micro-batched replays. On V1 a
    split decode size is captured at its first step, which runs as the capture; on V2
    the graph manager captures it before the step, which then replays it."""
    tokens, logprobs = by_prompt(results, "tokens"), by_prompt(results, "logprobs")
    expected_tokens, expected_logprobs = reference
    for index, (ours, theirs) in enumerate(zip(tokens, expected_tokens)):
        assert ours == theirs, f"prompt {index}: DBO {ours} != one rank {theirs}"
    for index, (ours, theirs) in enumerate(zip(logprobs, expected_logprobs)):
        worst = max(abs(a - b) for a, b in zip(ours, theirs))
        assert worst <= LOGPROB_ATOL, f"prompt {index}: logprobs differ by {worst}"
    for rank, result in enumerate(results):
        c = result["counters"]
        summary = f"rank {rank}: {c}"
        assert c["split_decode_steps"] >= 3 and c["split_prefill_steps"] >= 1, summary
        assert c["split_unequal_steps"] >= 1, summary
        # Each micro-batch hands over at every MoE dispatch and combine.
        assert c["yields_per_split_forward"] == 2 * 2 * MOE_LAYERS, summary
        if graphs == "eager":
            assert c["captured"] == 0 and c["split_replayed_steps"] == 0, summary
            continue
        assert c["split_captured"] >= 2, summary  # 4 tokens (2 + 2), 3 tokens (1 + 2)
        assert c["split_replayed_steps"] >= 1, summary
        assert c["split_task_updates"] == c["split_replayed_steps"], summary
        # Every split decode step ran as one graph of both micro-batches, the unequal
        # 1 + 2 split among them (the prefill step splits its padded 20 tokens 10 + 10).
        served = c["split_replayed_steps"] + (c["split_captured"] if runner == "v1" else 0)
        assert served == c["split_decode_steps"], summary


@pytest.mark.parametrize("graphs", ["eager", "full"])
def test_two_micro_batched_ranks_equal_one_rank_on_v2(
    tiny_moe, one_rank, tmp_path, monkeypatch, graphs
):
    """On Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``, as vLLM asks for DBO there)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    engine = {**DBO, **(FULL_GRAPHS if graphs == "full" else {})}
    results = run_rank_results(
        tiny_moe, 2, tmp_path, name=f"dbo-{graphs}", max_tokens=MAX_TOKENS, engine=engine
    )
    _check_micro_batched_ranks(results, one_rank, graphs, runner="v2")


def test_mla_moe_two_micro_batched_ranks_with_graphs_equal_one_rank(tmp_path):
    """A DeepSeek-V3-shaped MoE (``write_mla_moe_checkpoint``: MLA attention, grouped
    sigmoid routing with a correction bias, a shared expert, both layers MoE): one rank,
    eager, gives transformers' tokens; two ranks with DBO and FULL graphs give them."""
    model = write_mla_moe_checkpoint(tmp_path / "tiny-deepseek-v3-moe")
    one = run_rank_results(model, 1, tmp_path, max_tokens=MAX_TOKENS)
    tokens = by_prompt(one, "tokens")
    assert tokens == hf_greedy(model, PROMPTS, MAX_TOKENS), "one rank differs from transformers"
    engine = {**DBO, **FULL_GRAPHS}
    results = run_rank_results(
        model, 2, tmp_path, name="dbo-full", max_tokens=MAX_TOKENS, engine=engine
    )
    _check_micro_batched_ranks(results, (tokens, by_prompt(one, "logprobs")), "full")


def _check_replies(replies: list[dict], reference: tuple) -> None:
    for index, (reply, tokens, logprobs) in enumerate(zip(replies, *reference)):
        assert reply["tokens"] == tokens, f"prompt {index}: served {reply['tokens']} != {tokens}"
        worst = max(abs(a - b) for a, b in zip(reply["logprobs"], logprobs))
        assert worst <= LOGPROB_ATOL, f"prompt {index}: logprobs differ by {worst}"


def _complete(server: Server, index: int) -> dict:
    body = {
        "model": server.model,
        "prompt": " ".join(f"t{token}" for token in PROMPTS[index]),
        "max_tokens": MAX_TOKENS[index],
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, reply = server.post("/v1/completions", json.dumps(body).encode())
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["prompt_token_ids"] == PROMPTS[index], choice  # the word tokenizer's
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def _rank_counters(directory: Path) -> dict[int, dict]:
    """Each DP rank's counters, as its worker wrote them after its last step."""
    return {
        int(path.name[2 : path.name.index("-")]): json.loads(path.read_text())
        for path in directory.glob("dp*-rank0.json")
    }


# Eager DBO is covered offline (test_two_micro_batched_ranks_equal_one_rank) and served at
# vLLM's defaults (test_vllm_defaults); the eager server is an extended variant.
@pytest.mark.parametrize("graphs", [pytest.param("eager", marks=pytest.mark.extended), "full"])
def test_dp_server_with_micro_batches_equals_one_rank(tiny_moe, one_rank, tmp_path, graphs):
    """Rounds of the eight concurrent requests, until each rank has split a prefill
    step (at most ``SERVER_ROUNDS``): a step splits only when both ranks agree, and
    whether the two ranks' prefills meet in one step depends on when the requests
    reach them; every round's answers are checked."""
    log, counters = tmp_path / "server.log", tmp_path / "counters"
    counters.mkdir()
    env = {COUNTERS_DIR_ENV: str(counters)}
    with (
        serve(tiny_moe, SERVER_ARGS + SERVER_GRAPHS[graphs], log, env) as server,
        ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool,
    ):
        for _ in range(SERVER_ROUNDS):
            replies = list(pool.map(lambda index: _complete(server, index), range(len(PROMPTS))))
            _check_replies(replies, one_rank)
            ranks = _rank_counters(counters)
            if all(c["split_prefill_steps"] for c in ranks.values()) and len(ranks) == 2:
                break
    ranks = _rank_counters(counters)
    assert sorted(ranks) == [0, 1], ranks
    for rank, c in ranks.items():
        summary = f"rank {rank}: {c}"
        assert c["split_decode_steps"] >= 3 and c["split_prefill_steps"] >= 1, summary
        assert c["yields_per_split_forward"] == 2 * 2 * MOE_LAYERS, summary
        if graphs == "eager":
            assert c["captured"] == 0 and c["split_replayed_steps"] == 0, summary
            continue
        assert c["split_captured"] >= 1 and c["split_replayed_steps"] >= 1, summary
        assert c["split_task_updates"] == c["split_replayed_steps"], summary
        assert c["split_captured"] + c["split_replayed_steps"] == c["split_decode_steps"], summary
