"""Chat prompts for SmolLM2-135M-Instruct as token ids, and transformers' greedy answers."""

from __future__ import annotations

from pathlib import Path

import torch

QUESTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "What is 12 plus 30?",
    "Give one tip for writing clear code.",
    "Why is the sky blue? Answer in one sentence.",
    "Translate 'good morning' into Spanish.",
    "List the planets of the solar system in order from the sun, then say which is largest.",
)
MAX_TOKENS = 24
EOS_TOKEN_ID = 2  # <|im_end|>, SmolLM2's eos_token_id: ends an answer


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def chat_round(prompts: list[list[int]]) -> list[dict]:
    """One engine round: every prompt answered up to EOS or ``MAX_TOKENS``."""
    return [
        {"prompt": p, "max_tokens": MAX_TOKENS, "stop_token_ids": [EOS_TOKEN_ID]} for p in prompts
    ]


def chat_prompt_ids(model_dir: Path, questions: tuple[str, ...] = QUESTIONS) -> list[list[int]]:
    """Each question through the checkpoint's chat template, ready for the answer."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return [
        list(
            tokenizer.apply_chat_template(
                messages(q), add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in questions
    ]


def hf_chat_greedy(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, eos_token_id: int
) -> list[list[int]]:
    """Greedy answers from transformers, one prompt at a time in float32, ending at EOS
    (included, as vLLM reports a stop token) or after ``max_tokens``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    answers = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=eos_token_id,
                pad_token_id=eos_token_id,
            )
            answers.append(generated[0, len(prompt) :].tolist())
    return answers
