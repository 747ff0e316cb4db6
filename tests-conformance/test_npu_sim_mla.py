"""MLA and MTP speculative decoding on the simulated NPU (``npu_sim.py``), single rank.

A tiny DeepSeek-V3 (two MLA layers, 4 heads, dense MLPs) in the shape the ascend MLA
provider takes: ``kv_lora_rank`` 512, rope 64, ``qk_nope_head_dim`` = ``v_head_dim`` =
128 (the fused op's MLA constraints, which the stand-in checks; the 4 query heads are
read as the first of 32 in place, ``decode_heads``), with one MTP layer. The same
eight prompts as ``test_npu_sim_engine.py`` (5 to 300 tokens, up to three 128-token
blocks, a 64-token step budget: chunked prefill, decode batches of 1 to 8, a prefix-cache
hit of two blocks), float16. The absorbed decode runs the paged
``npu_fused_infer_attention_score_v2.out``, prefill chunks the non-paged v2 op, the latent
write ``npu_scatter_pa_kv_cache``; FULL_DECODE_ONLY graphs hold the write and the decode
as tasks of every MLA layer. Reference: transformers (each token its float32 argmax
given the run's tokens before it, within ``TIE_TOLERANCE``); with MTP (one speculative
token; on V2 the drafter's FULL graphs, on V1 its passes as vLLM dispatches them) also the
same engine's tokens without speculation.

In CI: V1 FULL_DECODE_ONLY without speculation, and MTP on V1 and V2 FULL_DECODE_ONLY.
``NPU_SIM_MLA_ALL=1`` adds V1/V2 eager and FULL_AND_PIECEWISE, V2 FULL_DECODE_ONLY and
MTP under FULL_AND_PIECEWISE (minutes; their results are in the README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_npu_sim_engine import (
    MAX_TOKENS,
    PROMPTS,
    RUNNER,
    SHARED_PREFIX,
    TIMEOUT_S,
    assert_transformers_tokens,
    check_graph_counters,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests-integration"))

from mla_checkpoints import write_mtp_checkpoint  # noqa: E402

pytestmark = [pytest.mark.npu_sim, pytest.mark.slow]

# What the ascend MLA provider takes (npu_attention.providers.ascend_mla.check_mla_spec).
ASCEND_MLA_SHAPE = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
)  # fmt: skip
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
ENGINE_ARGS = [
    "--max-num-seqs", "8", "--max-model-len", "512", "--max-num-batched-tokens", "64",
    "--kv-cache-bytes", str(64 * 2**20),
]  # fmt: skip
CAPTURE_SIZES = ["1", "2", "4", "8"]
# Verify steps of 1 + 1 tokens per request, up to 8 requests.
MTP_CAPTURE_SIZES = ["2", "4", "8", "16"]
ALL = os.environ.get("NPU_SIM_MLA_ALL") == "1"
BY_HAND = pytest.mark.skipif(not ALL, reason="by hand: NPU_SIM_MLA_ALL=1 (README)")


def run_npu_sim(
    model: Path, runner: str, mode: str, tmp_path: Path, *extra: str
) -> tuple[list[list[int]], dict]:
    """One ``npu_sim.py`` run of ``PROMPTS`` (``MAX_TOKENS`` each): (tokens, NPU report);
    fails the test with the run's output if it exits non-zero."""
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    command = [
        sys.executable, str(RUNNER), "--model", str(model), "--runner", runner,
        "--mode", mode, "--dtype", "float16", "--prompts", str(prompts_file),
        "--max-tokens", str(MAX_TOKENS), *ENGINE_ARGS, *extra,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                 if line.startswith(("TOKENS ", "NPU ")))  # fmt: skip
    return json.loads(lines["TOKENS"]), json.loads(lines["NPU"])


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 in the ascend MLA shape, with one MTP layer (vLLM's target
    model and transformers skip it; MTP drafts with it)."""
    return write_mtp_checkpoint(tmp_path_factory.mktemp("sim") / "deepseek", **ASCEND_MLA_SHAPE)


@pytest.fixture(scope="module")
def without_speculation(deepseek, tmp_path_factory) -> tuple[list[list[int]], dict]:
    """V1 FULL_DECODE_ONLY without speculation: the run MTP's tokens must equal."""
    tmp = tmp_path_factory.mktemp("mla-v1")
    return run_npu_sim(deepseek, "v1", "FULL_DECODE_ONLY", tmp, "--capture-sizes", *CAPTURE_SIZES)


def check_mla_run(report: dict, mode: str) -> None:
    """The MLA ops ran, the prefix-cache hit happened; graphs captured, replayed and
    updated with no synchronize inside a replayed step (or none at all, eager)."""
    calls = report["torch_npu_calls"]
    assert calls.get("npu_fused_infer_attention_score_v2.out", 0) > 0, calls  # decode
    assert calls.get("npu_fused_infer_attention_score_v2", 0) > 0, calls  # prefill
    assert calls.get("npu_scatter_pa_kv_cache", 0) > 0, calls  # latent write
    assert not any(name.startswith("atb.") for name in calls), calls  # no LSE without DCP
    check_graph_counters(report, mode)


def check_mla_tokens(deepseek: Path, tokens, report: dict, runner: str, mode: str) -> None:
    assert_transformers_tokens(deepseek, PROMPTS, tokens)
    check_mla_run(report, mode)
    assert report["cached_tokens"][6] >= SHARED_PREFIX, report["cached_tokens"]
    assert report["model_runner"] == ("HostModelRunner" if runner == "v1" else "HostModelRunnerV2")


def test_mla_v1_full_decode_only_gives_transformers_tokens(deepseek, without_speculation):
    tokens, report = without_speculation
    check_mla_tokens(deepseek, tokens, report, "v1", "FULL_DECODE_ONLY")


@BY_HAND
@pytest.mark.parametrize(
    ("runner", "mode"),
    [
        ("v1", "eager"),
        ("v2", "eager"),
        ("v2", "FULL_DECODE_ONLY"),
        ("v1", "FULL_AND_PIECEWISE"),
        ("v2", "FULL_AND_PIECEWISE"),
    ],
)
def test_mla_gives_transformers_tokens(deepseek, runner, mode, tmp_path):
    sizes = [] if mode == "eager" else ["--capture-sizes", *CAPTURE_SIZES]
    tokens, report = run_npu_sim(deepseek, runner, mode, tmp_path, *sizes)
    check_mla_tokens(deepseek, tokens, report, runner, mode)


def _mtp_params() -> list:
    graphs = [("v1", "FULL_DECODE_ONLY"), ("v2", "FULL_DECODE_ONLY")]
    by_hand = [("v1", "FULL_AND_PIECEWISE"), ("v2", "FULL_AND_PIECEWISE")]
    return [*graphs, *(pytest.param(*p, marks=BY_HAND) for p in by_hand)]


@pytest.mark.parametrize(("runner", "mode"), _mtp_params())
def test_mtp_with_drafter_graphs_keeps_the_tokens(
    deepseek, without_speculation, runner, mode, tmp_path
) -> None:
    """One MTP token per step: verify steps of 2 tokens per request replay the target's
    FULL graphs (the v2 op with the causal mask), on V2 the MTP layer's first passes its
    own FULL graphs (V1's run as vLLM dispatches them), each after a task update; the
    tokens are those without speculation."""
    sizes = ["--capture-sizes", *MTP_CAPTURE_SIZES]
    tokens, report = run_npu_sim(
        deepseek, runner, mode, tmp_path, *sizes, "--speculative-config", MTP
    )
    assert tokens == without_speculation[0]
    assert_transformers_tokens(deepseek, PROMPTS, tokens)
    check_mla_run(report, mode)
    # vLLM's prefix cache leaves the last matched block to EAGLE/MTP drafters.
    assert report["cached_tokens"][6] >= SHARED_PREFIX - 128, report["cached_tokens"]
    spec, graphs = report["spec_decode"], report["bridge_graphs"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == spec["num_drafts"], spec
    assert graphs["replayed_steps"] > 0, graphs  # the target's verify steps
    assert graphs["task_updates"] == graphs["replayed_steps"], graphs
    if runner == "v1":  # no drafter graph of the bridge's (docs/drafter-graphs.md)
        assert graphs["draft_captured"] == graphs["draft_replayed_steps"] == 0, graphs
        return
    assert graphs["draft_captured"] > 0 and graphs["draft_replayed_steps"] > 0, graphs
    assert graphs["draft_task_updates"] == graphs["draft_replayed_steps"], graphs
