"""Start vLLM engines in subprocesses (one platform per process) and collect results."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).with_name("engine_runner.py")
TIMEOUT_S = 600

# vLLM's own CPU platform and attention backends (CPU_ATTN, CPU_MLA), a reference beside
# transformers, need its compiled CPU ops: a vLLM built empty (as on Ascend hosts) has
# neither, and there transformers alone is the reference.
VLLM_CPU_BACKENDS = importlib.util.find_spec("vllm._C") is not None
NO_VLLM_CPU_BACKENDS = (
    "this vLLM is built empty (no vllm._C): it has no CPU platform or CPU attention "
    "backend of its own to compare with"
)

# Small KV pages and a small token budget: long prompts span many blocks and are
# prefilled in chunks; prefix caching on; several requests per step.
ENGINE = dict(
    dtype="float32",
    block_size=32,
    max_model_len=512,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
    gpu_memory_utilization=0.2,
    seed=0,
)

# KV cache of each rank in the two-rank engines (tiny models, max_model_len 512).
TWO_RANK_KV_CACHE_BYTES = 128 * 2**20

# An eager engine reserves no memory for graphs, so a fixed KV cache (thousands of tokens
# of the tiny models) serves it as well as a share of host memory, which vLLM would warm
# the model up to measure and then zero (about 4 GiB, seconds of each engine's start).
# Engines with graphs size it from gpu_memory_utilization: the bridge's workers reserve
# the graphs' profiled memory there first.
EAGER_KV_CACHE_BYTES = 64 * 2**20

# The real model (SmolLM2) at the sizes people serve it with; page size, token budget
# and KV cache (a share of host memory) are vLLM's own defaults rather than the above.
REAL_MODEL_ENGINE = dict(
    max_model_len=2048,
    max_num_seqs=16,
    block_size=None,
    max_num_batched_tokens=None,
    kv_cache_memory_bytes=None,
)


def kv_cache_sized(engine: dict) -> dict:
    """``engine`` (LLM keyword arguments), with ``EAGER_KV_CACHE_BYTES`` when it is eager
    and names no ``kv_cache_memory_bytes`` (``None`` included) of its own."""
    if not engine.get("enforce_eager") or "kv_cache_memory_bytes" in engine:
        return engine
    return {**engine, "kv_cache_memory_bytes": EAGER_KV_CACHE_BYTES}


def run_engine(
    model: Path,
    rounds: list[list[dict]],
    *,
    bridge: bool,
    tmp_path: Path,
    host_platform: dict | None = None,
    unset_env: tuple[str, ...] = (),
    **engine,
) -> dict:
    """Run ``rounds`` of generation in a fresh process; the bridge's host platform if
    ``bridge``, else vLLM's own CPU platform (CPU_ATTN); ``host_platform`` overrides
    attributes of the bridge's host platform; ``unset_env`` names variables removed
    from the engine's environment. Returns the runner's JSON."""
    spec = {"engine": kv_cache_sized({**ENGINE, **engine})}
    return _run_spec(model, rounds, spec, bridge, tmp_path, host_platform, unset_env)


def run_engines(
    model: Path,
    rounds: list[list[dict]],
    engines: list[dict],
    *,
    bridge: bool,
    tmp_path: Path,
    unset_env: tuple[str, ...] = (),
) -> list[dict]:
    """``run_engine`` for several engines (``ENGINE`` updated by each of ``engines``),
    one after the other in one process (vLLM is imported once). Returns one result each."""
    spec = {"engines": [kv_cache_sized({**ENGINE, **engine}) for engine in engines]}
    return _run_spec(model, rounds, spec, bridge, tmp_path, None, unset_env)["runs"]


def _run_spec(
    model: Path,
    rounds: list[list[dict]],
    spec: dict,
    bridge: bool,
    tmp_path: Path,
    host_platform: dict | None,
    unset_env: tuple[str, ...],
) -> dict:
    spec = {**spec, "model": str(model), "rounds": rounds, "host_platform": host_platform or {}}
    spec_path = tmp_path / f"spec-{os.getpid()}-{len(list(tmp_path.iterdir()))}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    for name in ("NPU_BRIDGE_DEVICE", *unset_env):
        env.pop(name, None)
    if bridge:
        env["NPU_BRIDGE_DEVICE"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(spec_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"engine run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])
