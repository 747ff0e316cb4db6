"""A tiny Llama-shaped ``config.json`` for the start-up checks' tests (vLLM's
``ModelConfig`` reads it; no weights)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "float32",
}


def write_config(path: Path, **fields) -> str:
    """``TINY_LLAMA`` updated by ``fields``, written to ``path/config.json``; returns
    ``path`` as a string (what ``ModelConfig(model=...)`` takes)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY_LLAMA, **fields}))
    return str(path)
