"""A checkpoint that carries per-tensor KV-cache scales in the form vLLM loads them.

llm-compressor's form, a compressed-tensors ``quantization_config`` with a
``kv_cache_scheme`` (8-bit float, one scale per tensor, symmetric) and no weight
quantization (empty ``config_groups``: every linear layer stays unquantized), and one
``k_scale`` / ``v_scale`` per layer beside its attention weights
(``model.layers.{i}.self_attn.k_scale``). vLLM 0.32 and 0.33 load these into each
``Attention`` layer's ``_k_scale`` / ``_v_scale`` (``CompressedTensorsKVCacheMethod``), and
with such a scheme ``kv_cache_dtype="auto"`` becomes ``fp8``. They load no scale into
an ``MLAAttention`` layer this way (the scheme's KV-cache method is for ``Attention``
only), so the checkpoints here are GQA ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

KV_CACHE_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}


def write_kv_scaled_checkpoint(
    source: Path, path: Path, k_scales: list[float], v_scales: list[float]
) -> Path:
    """Copy the checkpoint at ``source`` to ``path`` with the same weights, adding the
    KV-cache scheme and layer ``i``'s ``k_scales[i]`` / ``v_scales[i]``; returns ``path``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    if len(k_scales) != config["num_hidden_layers"] or len(v_scales) != len(k_scales):
        raise ValueError(
            f"expected one k and one v scale per layer ({config['num_hidden_layers']}), "
            f"got {len(k_scales)} and {len(v_scales)}"
        )
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": KV_CACHE_SCHEME,
    }
    config_path.write_text(json.dumps(config, indent=1))
    weights_path = path / "model.safetensors"
    weights = load_file(str(weights_path))
    for layer, (k_scale, v_scale) in enumerate(zip(k_scales, v_scales)):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(weights, str(weights_path), metadata={"format": "pt"})
    return path
