"""Decode context parallelism through vLLM's own engine in host mode: TP=2, DCP=2 over gloo.

vLLM 0.32 needs a tensor-parallel size above the model's KV heads for GQA/MQA DCP, so
the checkpoint is a tiny random Llama with one KV head (MQA), 4 query heads (2 per
rank). Each rank keeps every other token of every request in its KV cache; the bridge
all-gathers the query, attends the rank's share with its LSE and merges across ranks
(``attention/context_parallel.py``). Greedy tokens must equal transformers' and TP=2
without DCP, eager and with FULL_DECODE_ONLY host graphs (whose attention tasks get
each rank's KV lengths before every replay). The three engines run one after the
other in one process to start vLLM once (CI has two cores).

The same for MLA (``attention/mla_context_parallel.py``): a tiny DeepSeek-V3-shaped
checkpoint (4 heads, 2 per rank, one latent "KV head"), TP=2 with DCP=2 and with
DCP=1. Under DCP every row is an absorbed decode of the group's gathered heads over
the rank's latents; prompts are prefilled in chunks of 32 tokens, so prefill rows
attend to context on both ranks. The eager MLA engines use ``custom_ops=["none"]``
as in ``test_mla.py``.
"""

from __future__ import annotations

import random

import pytest
from checkpoints import hf_greedy, write_checkpoint
from engines import TWO_RANK_KV_CACHE_BYTES, run_engines
from mla_checkpoints import write_mla_checkpoint

# Prompts over several 64-token "virtual blocks" (32-token pages on each of 2 ranks);
# the 130-token one is prefilled in chunks of 64 (prefills with context on each rank).
_RNG = random.Random(13)
PROMPTS = tuple([_RNG.randrange(3, 500) for _ in range(n)] for n in (5, 70, 130))
MAX_TOKENS = (8, 5, 6)  # the decode batch shrinks as requests finish
TP2 = dict(tensor_parallel_size=2, max_model_len=512, kv_cache_memory_bytes=TWO_RANK_KV_CACHE_BYTES)
FULL = {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}
ENGINES = {
    "dcp2-eager": {**TP2, "decode_context_parallel_size": 2, "enforce_eager": True},
    # FULL_DECODE_ONLY with runs of 16 tokens per rank (cp_kv_cache_interleave_size).
    "dcp2-full-decode-only": {
        **TP2,
        **FULL,
        "decode_context_parallel_size": 2,
        "cp_kv_cache_interleave_size": 16,
    },
    "dcp1-eager": {**TP2, "enforce_eager": True},
}


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    model = write_checkpoint("llama_mqa", root / "llama-mqa")
    hf = hf_greedy(model, list(PROMPTS), list(MAX_TOKENS))
    rounds = [[{"prompt": p, "max_tokens": m} for p, m in zip(PROMPTS, MAX_TOKENS)]]
    runs = run_engines(
        model,
        rounds,
        list(ENGINES.values()),
        bridge=True,
        tmp_path=root,
        unset_env=("VLLM_CPU_OMP_THREADS_BIND",),
    )
    return hf, dict(zip(ENGINES, runs))


@pytest.mark.parametrize("name", [n for n in ENGINES if n.startswith("dcp2")])
def test_dcp2_equals_transformers_and_dcp1(dcp_runs, name):
    hf, runs = dcp_runs
    run = runs[name]
    assert "error" not in run, run["error"]
    assert run["platform"] == "HostPlatform"
    assert len(run["rank_counters"]) == 2
    if "full" in name:
        for rank in run["rank_counters"]:
            counters = rank["counters"]
            assert counters["replayed_steps"] > 0 and counters["task_updates"] > 0, rank
    assert run["tokens"] == [hf]
    assert runs["dcp1-eager"]["tokens"] == [hf]


MLA_ENGINE = dict(**TP2, block_size=16, max_num_batched_tokens=32)
MLA_EAGER = dict(enforce_eager=True, compilation_config={"custom_ops": ["none"]})
MLA_ENGINES = {
    "mla-dcp2-eager": {**MLA_ENGINE, **MLA_EAGER, "decode_context_parallel_size": 2},
    "mla-dcp2-full-decode-only": {
        **MLA_ENGINE,
        **FULL,
        "decode_context_parallel_size": 2,
        "cp_kv_cache_interleave_size": 16,
    },
    "mla-dcp1-eager": {**MLA_ENGINE, **MLA_EAGER},
}


@pytest.fixture(scope="module")
def mla_dcp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-dcp")
    model = write_mla_checkpoint(root / "deepseek-v3-tiny")
    hf = hf_greedy(model, list(PROMPTS), list(MAX_TOKENS))
    rounds = [[{"prompt": p, "max_tokens": m} for p, m in zip(PROMPTS, MAX_TOKENS)]]
    runs = run_engines(
        model,
        rounds,
        list(MLA_ENGINES.values()),
        bridge=True,
        tmp_path=root,
        unset_env=("VLLM_CPU_OMP_THREADS_BIND",),
    )
    return hf, dict(zip(MLA_ENGINES, runs))


@pytest.mark.parametrize("name", [n for n in MLA_ENGINES if "dcp2" in n])
def test_mla_dcp2_equals_transformers_and_dcp1(mla_dcp_runs, name):
    hf, runs = mla_dcp_runs
    run = runs[name]
    assert "error" not in run, run["error"]
    assert run["platform"] == "HostPlatform"
    assert len(run["rank_counters"]) == 2
    if "full" in name:
        for rank in run["rank_counters"]:
            counters = rank["counters"]
            assert counters["replayed_steps"] > 0, rank
            assert counters["task_updates"] == counters["replayed_steps"], rank
    assert run["tokens"] == [hf]
    assert runs["mla-dcp1-eager"]["tokens"] == [hf]
