"""vLLM on the simulated NPU with an int8 KV cache (``--kv-cache-dtype int8_per_token_head``).

``test_npu_sim_engine.py``'s tiny Llama and prompts (chunked prefill, a prefix-cache hit,
decode batches of 1 to 8) on V1 with FULL_DECODE_ONLY graphs, twice: on the simulated
NPU (the ascend provider writes int8 pages with their per-token-head scales and decodes
through the fused op's own dequantization, ``key_antiquant_mode=5``, in captured,
replayed and updated graphs) and in plain host mode (``--reference``: the reference
provider, host graphs) with the same kind. The tokens must be equal: both quantize each
row as vLLM defines the kind and dequantize in float32, and both pad their graph batches
alike (an eager run of the same prompts rounds its GEMMs otherwise and may break this
random-weight model's near ties differently, so the mode is the same on both sides).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_npu_sim_engine import (  # noqa: F401 (llama: the module's fixture)
    ENGINE_ARGS,
    MAX_TOKENS,
    PROMPTS,
    RUNNER,
    TIMEOUT_S,
    llama,
)

pytestmark = [pytest.mark.npu_sim]

KIND = "int8_per_token_head"


def run_int8(model: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    """One V1 FULL_DECODE_ONLY ``npu_sim.py`` run with the int8 kind: the process and its
    ``TOKENS`` / ``NPU`` lines."""
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    command = [
        sys.executable, str(RUNNER), "--model", str(model), "--runner", "v1",
        "--mode", "FULL_DECODE_ONLY", "--dtype", "float16", "--prompts", str(prompts_file),
        "--max-tokens", str(MAX_TOKENS), *ENGINE_ARGS, "--kv-cache-dtype", KIND, *extra,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False
    )
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("TOKENS ", "NPU ")))  # fmt: skip
    return done, {name: json.loads(text) for name, text in lines.items()}


def test_int8_kv_cache_on_the_simulated_npu(llama, tmp_path) -> None:  # noqa: F811
    done, lines = run_int8(llama, tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    tokens, report = lines["TOKENS"], lines["NPU"]
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(PROMPTS)
    reference, reference_lines = run_int8(llama, tmp_path, "--reference")
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-4000:]
    assert tokens == reference_lines["TOKENS"]
    quantized = report["quantized_kv_calls"]
    assert quantized.get("npu_fused_infer_attention_score.out (int8, key_antiquant_mode=5)", 0) > 0
    assert quantized.get("npu_scatter_pa_kv_cache (int8)", 0) > 0, report
    assert (
        report["torch_npu_calls"]["npu_scatter_pa_kv_cache"]
        == quantized["npu_scatter_pa_kv_cache (int8)"]
    ), "a write to pages that are not int8"
    assert report["graphs_captured"] > 0 and report["replays"] > 0, report
    assert report["task_updates"] > 0 and report["synchronizes"] == 0, report
    assert report["cached_tokens"][6] >= 2 * 128, report  # the prefix-cache hit
