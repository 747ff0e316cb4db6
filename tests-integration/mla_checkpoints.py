"""Tiny DeepSeek-V2-shaped (MLA) checkpoints with random weights written by transformers."""

from __future__ import annotations

from pathlib import Path

import torch

# Two layers of multi-head latent attention (4 heads, a 64-wide compressed KV,
# 32-wide no-rope and rope parts) with dense MLPs (first_k_dense_replace covers
# every layer, so no experts). Weights have a larger spread than the usual 0.02
# so that greedy decisions have clear margins.
MLA = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=2,
    max_position_embeddings=1024,
    initializer_range=0.15,
    tie_word_embeddings=False,
)

# The shape vLLM's own CPU_MLA decode kernel takes: a 512-wide compressed KV and a
# 64-wide rope part (latent rows of 576), with block size 16.
CPU_MLA_SHAPE = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)


def write_mla_checkpoint(path: Path, **overrides) -> Path:
    """Write a DeepSeek-V2 checkpoint (float32) to ``path`` and return it."""
    import transformers

    config = transformers.DeepseekV3Config(**{**MLA, **overrides})
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(1234)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return path
