"""Shared set-up: helper modules importable, tiny checkpoints written once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Random-weight Llama and Qwen2 checkpoints (float32, GQA 4:2, head size 64)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: write_checkpoint(name, root / name) for name in ("llama", "qwen2")}
