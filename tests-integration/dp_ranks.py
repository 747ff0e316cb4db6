"""Data-parallel MoE engines in host mode, one process per rank (``dp_rank_runner.py``),
on a tiny random Qwen3-MoE: the checkpoint and the runs the DP tests share.

Each rank is its own process group, stopped by id if it outlives the run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

RUNNER = Path(__file__).with_name("dp_rank_runner.py")
TIMEOUT_S = 600
PROMPTS = [[(7 * i + j * 13) % 500 + 3 for j in range(4 + i % 3)] for i in range(8)]
MAX_TOKENS = 12


def write_tiny_moe(path: Path) -> Path:
    """A two-layer Qwen3-MoE (8 experts, 2 per token) with random weights, float32."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
        initializer_range=0.15, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(7)
    transformers.Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_results(
    model: Path,
    dp_size: int,
    tmp_path: Path,
    *,
    name: str | None = None,
    max_tokens: int | list[int] = MAX_TOKENS,
    engine: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Each rank's ``RESULT`` (its prompts' tokens and logprobs, its counters), from
    ``dp_size`` rank processes generating ``PROMPTS`` greedily."""
    spec = {"model": str(model), "dp_size": dp_size, "port": _free_port(),
            "prompts": PROMPTS, "max_tokens": max_tokens, "engine": engine or {}}  # fmt: skip
    spec_path = tmp_path / f"{name or f'dp{dp_size}'}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, NPU_BRIDGE_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the host platform splits the CPUs
    procs = [
        subprocess.Popen(
            [sys.executable, str(RUNNER), str(spec_path), str(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(dp_size)
    ]
    try:
        outputs = [proc.communicate(timeout=TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    results = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"rank {rank} failed:\n{out[-2000:]}\n{err[-4000:]}"
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results


def by_prompt(results: list[dict[str, Any]], field: str) -> list:
    """``field`` of every prompt, in prompt order (rank ``r`` of ``n`` ran ``r::n``)."""
    merged: list = [None] * len(PROMPTS)
    for rank, result in enumerate(results):
        merged[rank :: len(results)] = result[field]
    return merged


def run_ranks(model: Path, dp_size: int, tmp_path: Path) -> list[list[int]]:
    """Every prompt's greedy tokens, from ``dp_size`` rank processes."""
    return by_prompt(run_rank_results(model, dp_size, tmp_path), "tokens")
