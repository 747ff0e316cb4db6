"""A real chat model, SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9:3, head size 64), at
the sizes people serve it with: ``max_model_len=2048``, ``max_num_seqs=16``.

Eight chat prompts (the checkpoint's own chat template) are answered greedily in one
batch, each up to its end-of-turn token or 24 tokens, so the decode batch shrinks as
answers end. Through the bridge, eager, with FULL_DECODE_ONLY and with
FULL_AND_PIECEWISE graphs, the answers must equal, token for token, vLLM's own CPU
backend's (CPU_ATTN, plugin inactive) and transformers' (float32, one prompt at a time;
the ``smollm2_chat`` fixture checks those two agree).
"""

from __future__ import annotations

import pytest
from engines import REAL_MODEL_ENGINE, run_engine

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


@pytest.mark.parametrize("mode", list(GRAPH_MODES))
def test_chat_answers_equal_cpu_attn_and_transformers(smollm2, smollm2_chat, tmp_path, mode):
    rounds, hf = smollm2_chat
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
