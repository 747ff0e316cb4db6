"""FULL graphs for a hybrid model: a Gemma-2-shaped checkpoint (soft cap, head size 256,
sliding-window and full layers alternating, so two KV-cache groups with a plan each).

Greedy tokens through the bridge with FULL_DECODE_ONLY and FULL_AND_PIECEWISE graphs
must equal transformers' (eager attention, which applies the soft cap and the windows)
and vLLM's own CPU_ATTN backend's. Prompts run past the window, so a window that a
replay applied with the wrong group's plan would change tokens; vLLM's own capture
counter must count the bridge's captures.
"""

from __future__ import annotations

import random

import pytest
import torch
from engines import VLLM_CPU_BACKENDS, run_engine

WINDOW = 32


def _write_gemma2(path):
    import transformers

    config = transformers.Gemma2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        max_position_embeddings=1024,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=None,
        query_pre_attn_scalar=256,
        initializer_range=0.15,
        tie_word_embeddings=True,
    )
    torch.manual_seed(4321)
    transformers.Gemma2ForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def _hf_greedy(path, rounds):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = []
    with torch.no_grad():
        for round_ in rounds:
            outs = []
            for item in round_:
                ids = torch.tensor([item["prompt"]])
                generated = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=item["max_tokens"],
                    min_new_tokens=item["max_tokens"],
                    do_sample=False,
                    pad_token_id=0,
                )
                outs.append(generated[0, ids.shape[1] :].tolist())
            tokens.append(outs)
    return tokens


def _rounds() -> list[list[dict]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (6, 45, 90, 150)]
    return [[{"prompt": p, "max_tokens": m} for p, m in zip(prompts, (20, 16, 12, 18))]]


ROUNDS = _rounds()


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    path = _write_gemma2(tmp_path_factory.mktemp("gemma2") / "gemma2-tiny")
    hf = _hf_greedy(path, ROUNDS)
    if VLLM_CPU_BACKENDS:
        cpu_attn = run_engine(path, ROUNDS, bridge=False, tmp_path=tmp_path_factory.mktemp("cpu"))
        assert cpu_attn["tokens"] == hf, "vLLM CPU_ATTN differs from transformers (reference check)"
    return path, hf


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_full_graphs_of_two_kv_groups_match_transformers(gemma2, tmp_path, mode):
    model, hf = gemma2
    result = run_engine(
        model,
        ROUNDS,
        bridge=True,
        tmp_path=tmp_path,
        enforce_eager=False,
        compilation_config={"cudagraph_mode": mode},
    )
    assert "error" not in result, result
    assert result["tokens"] == hf
    counters = result["counters"]
    assert counters["replayed_steps"] > 0 and counters["task_updates"] > 0, counters
    assert result["vllm_cudagraph_captured"] >= counters["captured"] > 0, result
