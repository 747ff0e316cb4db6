"""Shared set-up: helper modules importable, checkpoints written once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

from host_threads import set_default_omp_threads

set_default_omp_threads()  # before torch: this process and the engines it starts

from checkpoints import write_checkpoint  # noqa: E402


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
