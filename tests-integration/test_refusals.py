"""vLLM with the bridge refuses, at start-up and naming the cause, what it cannot run."""

from __future__ import annotations

import json

import pytest
from checkpoints import write_checkpoint
from engines import run_engine

ROUND = [[{"prompt": [5, 6, 7], "max_tokens": 2}]]


def _refusal(model, tmp_path, **engine) -> str:
    result = run_engine(model, ROUND, bridge=True, tmp_path=tmp_path, **engine)
    assert "error" in result, f"the engine started and generated {result.get('tokens')}"
    return result["error"]


def test_unsupported_head_size(tmp_path):
    model = write_checkpoint("llama", tmp_path / "llama-head48", head_dim=48)
    error = _refusal(model, tmp_path, enforce_eager=True)
    assert "head size 48" in error and "'reference' attention provider" in error
    assert "[32, 64, 80, 96, 112, 128, 160, 192, 224, 256]" in error


def test_kv_cache_kind_the_provider_lacks(checkpoints, tmp_path):
    error = _refusal(checkpoints["llama"], tmp_path, enforce_eager=True, kv_cache_dtype="fp8_e5m2")
    assert "kv_cache_dtype='fp8_e5m2'" in error and "'reference' attention provider" in error
    assert (
        "it takes kv_cache_dtype in ['auto', 'fp8', 'fp8_e4m3', 'int8_per_token_head', "
        "'fp8_per_token_head']" in error
    )


def test_mla_widths_the_provider_cannot_take(tmp_path):
    """A DeepSeek-V2-shaped config (MLA) whose compressed KV is wider than the reference
    MLA provider takes; the dummy loader needs no weights."""
    model = tmp_path / "deepseek-v2-mla"
    model.mkdir()
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 2048,
        "q_lora_rank": None,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
    }
    (model / "config.json").write_text(json.dumps(config))
    error = _refusal(model, tmp_path, enforce_eager=True, load_format="dummy")
    assert "'reference' MLA provider" in error and "kv_lora_rank=2048" in error


@pytest.mark.parametrize("block_size", [24])
def test_block_size_not_multiple_of_16(checkpoints, tmp_path, block_size):
    error = _refusal(checkpoints["llama"], tmp_path, enforce_eager=True, block_size=block_size)
    assert f"multiple of 16, got block_size={block_size}" in error
