"""Host mode on a vLLM built empty (``VLLM_TARGET_DEVICE=empty``, no ``vllm._C``), as
Ascend hosts install it: what it refuses at start-up, naming the cause."""

from __future__ import annotations

import pytest
from engines import VLLM_CPU_BACKENDS, run_engine

pytestmark = pytest.mark.skipif(VLLM_CPU_BACKENDS, reason="this vLLM has its compiled ops")

ROUND = [[{"prompt": [5, 6, 7], "max_tokens": 2}]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}


def test_v1_speculation_is_refused_and_v2_runs_it(checkpoints, tmp_path, monkeypatch):
    """V1's CPU rejection sampler is a vllm._C op: refused, pointing at V2; on V2 the same
    engine generates."""
    model = checkpoints["llama"]
    refused = run_engine(
        model, ROUND, bridge=True, tmp_path=tmp_path, enforce_eager=True,
        speculative_config=NGRAM, unset_env=("VLLM_USE_V2_MODEL_RUNNER",),
    )  # fmt: skip
    assert "error" in refused, f"V1 generated {refused.get('tokens')}"
    assert "Model Runner V2 only" in refused["error"] and "'ngram'" in refused["error"]
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    ran = run_engine(
        model, ROUND, bridge=True, tmp_path=tmp_path, enforce_eager=True, speculative_config=NGRAM
    )
    assert "error" not in ran, ran["error"]
    assert len(ran["tokens"][0][0]) == 2
