"""A Llama whose first layer attends through a 48-token sliding window, the second fully.

vLLM puts the two kinds of layers in two KV-cache groups, each with its own plan per
step. Greedy tokens through the bridge (eager, PIECEWISE graphs, and FULL graphs whose
attention tasks are updated with their own group's plan) must equal vLLM's own CPU_ATTN
backend's (transformers' Llama does not apply ``layer_types`` windows, so it is no
reference here).
"""

from __future__ import annotations

import random

import pytest
from checkpoints import write_checkpoint
from engines import NO_VLLM_CPU_BACKENDS, VLLM_CPU_BACKENDS, run_engine

WINDOW = 48


def _rounds() -> list[list[dict]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 60, 130, 200)]
    return [[{"prompt": p, "max_tokens": 24} for p in prompts]]


ROUNDS = _rounds()


# vLLM's CPU_ATTN is the only reference here.
pytestmark = pytest.mark.skipif(not VLLM_CPU_BACKENDS, reason=NO_VLLM_CPU_BACKENDS)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    path = tmp_path_factory.mktemp("windowed") / "llama-sliding"
    write_checkpoint(
        "llama", path, layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW
    )
    cpu_attn = run_engine(path, ROUNDS, bridge=False, tmp_path=tmp_path_factory.mktemp("cpu"))
    return path, cpu_attn["tokens"]


@pytest.mark.parametrize(
    "engine",
    [
        {"enforce_eager": True},
        {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}},
        {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
    ],
    ids=["eager", "piecewise", "full-decode-only"],
)
def test_sliding_window_matches_cpu_attn(windowed, tmp_path, engine):
    model, cpu_attn = windowed
    result = run_engine(model, ROUNDS, bridge=True, tmp_path=tmp_path, **engine)
    assert result["tokens"] == cpu_attn
    mode = engine.get("compilation_config", {}).get("cudagraph_mode")
    if mode == "PIECEWISE":
        assert result["counters"]["piecewise_steps"] > 0, result["counters"]
    if mode == "FULL_DECODE_ONLY":
        assert result["counters"]["replayed_steps"] > 0, result["counters"]
