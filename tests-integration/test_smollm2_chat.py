"""A real chat model, SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9:3, head size 64), at
the sizes people serve it with: ``max_model_len=2048``, ``max_num_seqs=16``.

Eight chat prompts (the checkpoint's own chat template) are answered greedily in one
batch, each up to its end-of-turn token or 24 tokens, so the decode batch shrinks as
answers end. Through the bridge, eager, with FULL_DECODE_ONLY and with
FULL_AND_PIECEWISE graphs, the answers must equal, token for token, vLLM's own CPU
backend's (CPU_ATTN, plugin inactive) and transformers' (float32, one prompt at a time).
"""

from __future__ import annotations

import pytest
from chat_prompts import MAX_TOKENS, chat_prompt_ids, hf_chat_greedy
from engines import run_engine

# vLLM's defaults but for these: the sizes under test, the page size and token budget
# of vLLM's own CPU default rather than the small ones of the tiny-checkpoint tests.
REAL_MODEL_ENGINE = dict(
    max_model_len=2048, max_num_seqs=16, block_size=None, max_num_batched_tokens=None
)
EOS_TOKEN_ID = 2  # <|im_end|>, the checkpoint's eos_token_id

GRAPH_MODES = {
    "eager": {"enforce_eager": True},
    "FULL_DECODE_ONLY": {
        "enforce_eager": False,
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"},
    },
    "FULL_AND_PIECEWISE": {
        "enforce_eager": False,
        "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
    },
}


@pytest.fixture(scope="module")
def chat_references(smollm2, tmp_path_factory):
    """The chat rounds, transformers' answers and vLLM CPU_ATTN's (eager) answers."""
    prompts = chat_prompt_ids(smollm2)
    rounds = [
        [{"prompt": p, "max_tokens": MAX_TOKENS, "stop_token_ids": [EOS_TOKEN_ID]} for p in prompts]
    ]
    hf = hf_chat_greedy(smollm2, prompts, MAX_TOKENS, EOS_TOKEN_ID)
    cpu_attn = run_engine(
        smollm2,
        rounds,
        bridge=False,
        tmp_path=tmp_path_factory.mktemp("cpu-attn"),
        enforce_eager=True,
        **REAL_MODEL_ENGINE,
    )
    assert cpu_attn["platform"] == "CpuPlatform", cpu_attn
    assert cpu_attn["tokens"] == [hf], "vLLM CPU_ATTN differs from transformers (reference check)"
    # Some answers end early, some run to the limit: the decode batch shrinks.
    assert len({len(answer) for answer in hf}) > 1, hf
    return rounds, hf


@pytest.mark.parametrize("mode", list(GRAPH_MODES))
def test_chat_answers_equal_cpu_attn_and_transformers(smollm2, chat_references, tmp_path, mode):
    rounds, hf = chat_references
    result = run_engine(
        smollm2, rounds, bridge=True, tmp_path=tmp_path, **REAL_MODEL_ENGINE, **GRAPH_MODES[mode]
    )
    assert "error" not in result, result["error"]
    assert result["platform"] == "HostPlatform", result
    for index, (ours, theirs) in enumerate(zip(result["tokens"][0], hf)):
        assert ours == theirs, f"prompt {index}: bridge {ours} != transformers/CPU_ATTN {theirs}"
    counters = result["counters"]
    if mode == "eager":
        assert counters["captured"] == 0 and counters["replayed_steps"] == 0, counters
        return
    assert counters["replayed_steps"] > 0, counters
    assert counters["task_updates"] > 0, counters
    assert result["vllm_cudagraph_captured"] >= counters["captured"] > 0, result
