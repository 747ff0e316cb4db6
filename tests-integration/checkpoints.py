"""Tiny random-weight checkpoints written by transformers, and HF greedy generation."""

from __future__ import annotations

from pathlib import Path

import torch

# Two layers, 4 query heads and 2 KV heads of 64 (GQA). Weights are drawn with a
# larger spread than the usual 0.02 so that greedy decisions have clear margins.
COMMON = dict(
    vocab_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.15,
    tie_word_embeddings=False,
)


def write_checkpoint(kind: str, path: Path, **overrides) -> Path:
    """Write a ``llama``, ``llama_mqa`` (one KV head: MQA, what decode context
    parallelism over two tensor-parallel ranks needs) or ``qwen2`` checkpoint to
    ``path`` and return it."""
    import transformers

    if kind == "llama_mqa":
        return write_checkpoint("llama", path, **{"num_key_value_heads": 1, **overrides})
    if kind == "llama":
        config = transformers.LlamaConfig(
            **{**COMMON, "hidden_size": 128, "intermediate_size": 256, "head_dim": 64, **overrides}
        )
        model_cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(
            **{**COMMON, "hidden_size": 256, "intermediate_size": 256, **overrides}
        )
        model_cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown checkpoint kind {kind!r}")
    torch.manual_seed(1234)
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy tokens from transformers itself, one prompt at a time, in float32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.no_grad():
        for prompt, count in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=count,
                min_new_tokens=count,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def write_word_tokenizer(path: Path, vocab_size: int) -> Path:
    """Save a word-level tokenizer to ``path`` (beside a checkpoint, for a server): token
    ``i`` is the word ``t{i}``, text is words separated by spaces, and no special token
    is added, so the prompt ``"t3 t16"`` is the ids ``[3, 16]``."""
    import tokenizers
    import transformers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(
        path
    )
    return path
