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


def write_mtp_checkpoint(path: Path, num_mtp_layers: int = 1, **overrides) -> Path:
    """A DeepSeek-V3 checkpoint (``MLA`` with ``overrides``, float32) with
    ``num_mtp_layers`` MTP layers.

    transformers writes the target layers and knows nothing of MTP layers; they are
    added to its safetensors in the layout vLLM's ``DeepSeekMTP`` loads, after the
    target's last layer ``L = num_hidden_layers``: ``model.layers.{L + i}.enorm``,
    ``hnorm``, ``eh_proj`` (``[hidden, 2 * hidden]``), ``shared_head.norm``,
    ``shared_head.head`` (an LM head), ``embed_tokens`` and a decoder layer shaped like
    the target's (MLA attention, dense MLP). ``first_k_dense_replace`` is raised past
    the MTP layers so that they are dense (the target's layers are dense either way).
    Random weights: acceptance changes, greedy output does not.
    """
    import json

    from safetensors.torch import load_file, save_file

    write_mla_checkpoint(path, **overrides)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    layers = config["num_hidden_layers"]
    config["num_nextn_predict_layers"] = num_mtp_layers
    config["first_k_dense_replace"] = layers + num_mtp_layers
    config_path.write_text(json.dumps(config, indent=1))

    weights_path = path / "model.safetensors"
    weights = load_file(str(weights_path))
    hidden, std = config["hidden_size"], config["initializer_range"]
    generator = torch.Generator().manual_seed(4321)

    def like(tensor: torch.Tensor, name: str) -> torch.Tensor:
        if "norm" in name:
            return torch.ones_like(tensor)
        return torch.randn(tensor.shape, generator=generator) * std

    last = f"model.layers.{layers - 1}."
    for i in range(num_mtp_layers):
        prefix = f"model.layers.{layers + i}."
        for name, tensor in list(weights.items()):
            if name.startswith(last):
                weights[prefix + name[len(last) :]] = like(tensor, name)
        weights.update(
            {
                prefix + "enorm.weight": torch.ones(hidden),
                prefix + "hnorm.weight": torch.ones(hidden),
                prefix + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator)
                * std,
                prefix + "shared_head.norm.weight": torch.ones(hidden),
                prefix + "shared_head.head.weight": weights["lm_head.weight"].clone(),
                prefix + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
            }
        )
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(weights_path),
        metadata={"format": "pt"},
    )
    return path


# A DeepSeek-V3-shaped MoE on the same attention: both layers route each token to 2 of 8
# experts (sigmoid scores, 2 groups of 4 of which 1 is chosen, scores renormalised and
# scaled by routed_scaling_factor 2.5) beside one shared expert. transformers' router is
# always sigmoid with the correction bias, and its config has no key for either; vLLM reads
# them from the config (without them it routes by softmax, and tokens leave transformers').
MLA_MOE = dict(
    first_k_dense_replace=0,
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    n_shared_experts=1,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
)


def write_mla_moe_checkpoint(path: Path) -> Path:
    """Write a DeepSeek-V3 MoE checkpoint (``MLA`` attention, ``MLA_MOE`` experts, float32)
    to ``path`` and return it. transformers initialises the routers' expert-selection bias
    (``e_score_correction_bias``) to zeros; it is drawn here (std 0.1, beside sigmoid
    scores in (0, 1)), so that it takes part in the choice of experts."""
    from safetensors.torch import load_file, save_file

    write_mla_checkpoint(path, **MLA_MOE)
    weights_path = path / "model.safetensors"
    weights = load_file(str(weights_path))
    generator = torch.Generator().manual_seed(5)
    for name, tensor in weights.items():
        if name.endswith("e_score_correction_bias"):
            weights[name] = torch.randn(tensor.shape, generator=generator) * 0.1
    save_file(weights, str(weights_path), metadata={"format": "pt"})
    return path
