"""MLA (DeepSeek latent attention) through real vLLM with the bridge's host platform.

A tiny DeepSeek-V3-shaped checkpoint (2 layers of multi-head latent attention, dense
MLPs, random weights written by transformers) runs the same prompts:

* through vLLM with the bridge: eager, FULL_DECODE_ONLY host graphs (MLA latent write
  and absorbed decode as updatable tasks, replayed after each step's update) and
  FULL_AND_PIECEWISE;
* through transformers' greedy ``generate``.

Greedy tokens must be identical. Prompts span up to 5 KV blocks of 16 tokens, run
together under a 32-token budget (chunked prefill), and a second round reuses the
first round's prefix (a prefix-cache hit): vLLM's own CPU platform turns chunked
prefill and prefix caching off for MLA, the bridge keeps them on.

vLLM's CPU custom ops (its C++ non-neox rotary embedding among them) give other
logits than transformers for this model in eager mode, vLLM's own CPU_MLA backend
included; the eager engines run with ``custom_ops=["none"]`` (vLLM's torch
implementations), as vLLM's compiled modes do.

Also compared: vLLM's own CPU_MLA backend, on the only shape its decode kernel takes
(kv_lora_rank 512, rope 64, block size 16).
"""

from __future__ import annotations

import random

import pytest
from checkpoints import hf_greedy
from engines import NO_VLLM_CPU_BACKENDS, VLLM_CPU_BACKENDS, run_engine
from mla_checkpoints import CPU_MLA_SHAPE, write_mla_checkpoint

BLOCK_SIZE = 16
# vLLM 0.32's CPU kernels on a CPU with AMX refuse float32 weights with this message.
CPU_MLA_WANTS_16_BIT_WEIGHTS = "expect weight to be bfloat16, float16"
LENGTHS = (9, 40, 70)
MAX_TOKENS = (8, 6, 4)  # the decode batch shrinks as requests finish
ENGINE = dict(block_size=BLOCK_SIZE, max_num_batched_tokens=32)
EAGER = dict(enforce_eager=True, compilation_config={"custom_ops": ["none"]})
CAPTURE_SIZES = [1, 2, 4, 8]  # 8: round two's 5 new tokens after its prefix hit


def _rounds() -> list[list[dict]]:
    rng = random.Random(0)
    first = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    # Round two: the longest prompt's first 64 tokens (4 full blocks, cached) + new ones.
    second = [first[2][:64] + [rng.randrange(3, 500) for _ in range(5)]]
    return [
        [{"prompt": p, "max_tokens": m} for p, m in zip(first, MAX_TOKENS)],
        [{"prompt": p, "max_tokens": 6} for p in second],
    ]


ROUNDS = _rounds()


def _hf(model, rounds) -> list[list[list[int]]]:
    return [
        hf_greedy(model, [item["prompt"] for item in r], [item["max_tokens"] for item in r])
        for r in rounds
    ]


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    """The checkpoint and transformers' greedy tokens for ``ROUNDS``."""
    model = write_mla_checkpoint(tmp_path_factory.mktemp("mla") / "deepseek-v3-tiny")
    return model, _hf(model, ROUNDS)


def _check(result, hf) -> None:
    assert result.get("platform") == "HostPlatform", result.get("error", result)
    for round_index, (ours, theirs) in enumerate(zip(result["tokens"], hf)):
        for prompt_index, (a, b) in enumerate(zip(ours, theirs)):
            assert a == b, f"round {round_index}, prompt {prompt_index}: bridge {a} != HF {b}"
    # Round two started from the prefix cache (whole 16-token blocks).
    assert result["cached_tokens"][1][0] >= 64, result["cached_tokens"]


def test_eager_matches_transformers(mla_model, tmp_path):
    model, hf = mla_model
    result = run_engine(model, ROUNDS, bridge=True, tmp_path=tmp_path, **ENGINE, **EAGER)
    _check(result, hf)
    states = result["states"]
    for state in ("PREFILL_NO_CACHE", "PREFILL_CACHE_HIT", "CHUNKED_PREFILL", "DECODE_ONLY"):
        assert states.get(state, 0) > 0, (state, states)


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_graphs_match_transformers(mla_model, tmp_path, mode):
    model, hf = mla_model
    compilation = {"cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}
    # FULL_AND_PIECEWISE captures at start-up, as on the NPU, so that a prefill size seen
    # once replays its pieces (captured at first use it would only be recorded).
    host_platform = {}
    if mode == "FULL_AND_PIECEWISE":
        compilation["mode"] = "VLLM_COMPILE"
        host_platform["capture_on_first_use"] = False
    result = run_engine(
        model, ROUNDS, bridge=True, tmp_path=tmp_path, compilation_config=compilation,
        host_platform=host_platform, **ENGINE,
    )  # fmt: skip
    _check(result, hf)
    counters = result["counters"]
    assert result["vllm_cudagraph_captured"] > 0, counters
    # Decode steps replayed FULL graphs, each after an update of the MLA tasks.
    assert counters["replayed_steps"] > 0, counters
    assert counters["task_updates"] == counters["replayed_steps"], counters
    if mode == "FULL_AND_PIECEWISE":
        assert counters["piecewise_steps"] > 0, counters


@pytest.mark.skipif(not VLLM_CPU_BACKENDS, reason=NO_VLLM_CPU_BACKENDS)
def test_cpu_mla_shape_matches_vllm_cpu_mla_and_transformers(tmp_path_factory):
    """vLLM's own MLA backend (CPU_MLA, the plugin inactive) on the shape its decode
    kernel takes, against the bridge with FULL_DECODE_ONLY graphs."""
    root = tmp_path_factory.mktemp("mla-576")
    model = write_mla_checkpoint(root / "deepseek-v3-576", **CPU_MLA_SHAPE)
    rounds = [ROUNDS[0][:2]]
    hf = _hf(model, rounds)
    compilation = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2]}
    ours = run_engine(
        model, rounds, bridge=True, tmp_path=root, compilation_config=compilation, **ENGINE
    )
    assert ours.get("platform") == "HostPlatform", ours.get("error", ours)
    assert ours["tokens"] == hf
    assert ours["vllm_cudagraph_captured"] > 0
    cpu_mla = run_engine(model, rounds, bridge=False, tmp_path=root, **ENGINE, **EAGER)
    if CPU_MLA_WANTS_16_BIT_WEIGHTS in cpu_mla.get("error", ""):
        pytest.skip(
            "the bridge equals transformers; vLLM's own CPU path on this CPU takes 16-bit "
            f"weights only ({cpu_mla['error']}), so CPU_MLA cannot run the float32 model"
        )
    assert cpu_mla.get("platform") == "CpuPlatform", cpu_mla
    assert cpu_mla["tokens"] == hf, "vLLM CPU_MLA differs from transformers (reference check)"
    assert ours["tokens"] == cpu_mla["tokens"]
