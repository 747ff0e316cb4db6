"""Tiny random-weight draft checkpoints for speculative decoding (EAGLE-style)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from checkpoints import COMMON


def write_eagle_draft(target: Path, path: Path, num_layers: int = 1) -> Path:
    """An EAGLE draft head for the ``llama`` checkpoint at ``target``, in the layout
    vLLM's ``EagleLlamaForCausalLM`` loads: ``fc`` ([hidden, 2 * hidden], token
    embedding and target hidden state in), ``num_layers`` Llama decoder layers named
    ``layers.{i}.*``, and the target's token embedding (its LM head is shared).
    Random weights: acceptance changes, greedy output does not."""
    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    config.update(num_hidden_layers=num_layers, architectures=["LlamaForCausalLM"])
    hidden = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    generator = torch.Generator().manual_seed(4321)
    std = COMMON["initializer_range"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    weights = {
        "fc.weight": rand(hidden, 2 * hidden),
        "embed_tokens.weight": rand(config["vocab_size"], hidden),
    }
    for i in range(num_layers):
        prefix = f"layers.{i}."
        if i:  # EAGLE's first layer has no input norm (fc's output goes straight in)
            weights[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        weights.update(
            {
                prefix + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                prefix + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                prefix + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                prefix + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                prefix + "mlp.gate_proj.weight": rand(inter, hidden),
                prefix + "mlp.up_proj.weight": rand(inter, hidden),
                prefix + "mlp.down_proj.weight": rand(hidden, inter),
                prefix + "post_attention_layernorm.weight": torch.ones(hidden),
            }
        )
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path
