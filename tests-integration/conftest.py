"""Shared set-up: helper modules importable, checkpoints written once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

from host_threads import set_default_omp_threads

set_default_omp_threads()  # before torch: this process and the engines it starts

from chat_prompts import (  # noqa: E402
    EOS_TOKEN_ID,
    MAX_TOKENS,
    chat_prompt_ids,
    chat_round,
    hf_chat_greedy,
)
from checkpoints import write_checkpoint  # noqa: E402
from engines import REAL_MODEL_ENGINE, VLLM_CPU_BACKENDS, run_engine  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Random-weight Llama and Qwen2 checkpoints (float32, GQA 4:2, head size 64)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: write_checkpoint(name, root / name) for name in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF checkpoint (converted once, then cached)."""
    from smollm2 import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="session")
def smollm2_chat(smollm2, tmp_path_factory) -> tuple[list[list[dict]], list[list[int]]]:
    """SmolLM2's chat round (prompt ids from its chat template) and the greedy answers of
    transformers (float32, one prompt at a time), checked equal to vLLM CPU_ATTN's where
    vLLM has it (not on an empty build)."""
    prompts = chat_prompt_ids(smollm2)
    rounds = [chat_round(prompts)]
    hf = hf_chat_greedy(smollm2, prompts, MAX_TOKENS, EOS_TOKEN_ID)
    # Some answers end early, some run to the limit: the decode batch shrinks.
    assert len({len(answer) for answer in hf}) > 1, hf
    if not VLLM_CPU_BACKENDS:
        return rounds, hf
    cpu_attn = run_engine(
        smollm2,
        rounds,
        bridge=False,
        tmp_path=tmp_path_factory.mktemp("cpu-attn"),
        enforce_eager=True,
        **REAL_MODEL_ENGINE,
    )
    assert cpu_attn["platform"] == "CpuPlatform", cpu_attn
    assert cpu_attn["tokens"] == [hf], "vLLM CPU_ATTN differs from transformers (reference check)"
    return rounds, hf
