"""vLLM on the simulated NPU (``npu_sim.py``): tokens equal transformers' in float16.

Each run is one ``npu_sim.py`` process: vLLM in host mode with the stand-in torch_npu,
the ascend provider, planes KV pages and the ``npu`` graph backend, every graph
captured at start-up; the simulated NPU replays each graph op by op (aten ops and whole
torch_npu ops) and refuses what the NPU cannot do. The tiny Llama (GQA 4:2, head size
128) and a Mistral with a 48-token sliding window run eight prompts of 5 to 300 tokens
(up to three 128-token blocks) with a 64-token step budget, so prefills are chunked and
decode batches go from 1 to 8 requests; the seventh prompt repeats the first 256 tokens
of the fourth (a prefix-cache hit of two blocks). Reference: transformers. Random-weight
models have near ties (top-2 logits 0.0003 apart in float32 for some seed's prompts), which
float16 rounding breaks either way (a graph's padded batch rounds its GEMMs unlike an
eager one's), so each token the engine picks must be transformers' float32 argmax given
the engine's own tokens before it, up to ``TIE_TOLERANCE`` in logit (a stale attention
misses by whole units); most equal transformers' float16 greedy tokens outright. Then
five deliberate faults, each caught.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests-integration"))

from checkpoints import write_checkpoint  # noqa: E402

pytestmark = [pytest.mark.npu_sim, pytest.mark.slow]

RUNNER = HERE / "npu_sim.py"
MAX_TOKENS = 8
PROMPT_LENS = (5, 23, 150, 300, 12, 40, 260, 7)
SHARED_PREFIX = 256  # the seventh prompt repeats the fourth's first two blocks
WINDOW = 48
TIE_TOLERANCE = 0.05  # logit gap to transformers' argmax a float16 run may take
ENGINE_ARGS = [
    "--max-num-seqs", "8", "--max-model-len", "512", "--max-num-batched-tokens", "64",
    "--capture-sizes", "1", "2", "4", "8", "--kv-cache-bytes", str(64 * 2**20),
]  # fmt: skip
TIMEOUT_S = 900


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS]
    prompts[6] = prompts[3][:SHARED_PREFIX] + prompts[6][SHARED_PREFIX:]
    return prompts


PROMPTS = _prompts()


def argmax_gaps(path: Path, prompts: list[list[int]], tokens: list[list[int]]) -> list[float]:
    """Per prompt, the largest gap between transformers' float32 top logit and the logit
    of the token the engine picked, each position given the engine's tokens before it."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gaps = []
    with torch.no_grad():
        for prompt, generated in zip(prompts, tokens, strict=True):
            logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(generated)[:, None])[:, 0]
            gaps.append(float((logits.max(-1).values - chosen).max()))
    return gaps


def assert_transformers_tokens(path: Path, prompts: list[list[int]], tokens) -> None:
    assert tokens is not None and [len(t) for t in tokens] == [MAX_TOKENS] * len(prompts)
    gaps = argmax_gaps(path, prompts, tokens)
    assert max(gaps) <= TIE_TOLERANCE, f"logit gaps to transformers' argmax: {gaps}"


def run_simulated(
    model: Path, runner: str, mode: str, tmp_path: Path, prompts: list[list[int]] = PROMPTS,
    fault: str | None = None,
) -> tuple[int, list[list[int]] | None, dict | None, str]:  # fmt: skip
    """One ``npu_sim.py`` run: (exit status, tokens, NPU report, output)."""
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    command = [
        sys.executable, str(RUNNER), "--model", str(model), "--runner", runner,
        "--mode", mode, "--dtype", "float16", "--prompts", str(prompts_file),
        "--max-tokens", str(MAX_TOKENS), *ENGINE_ARGS,
    ]  # fmt: skip
    if fault is not None:
        command += ["--fault", fault]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False
    )
    output = done.stdout + done.stderr
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines()
             if line.startswith(("TOKENS ", "NPU "))}  # fmt: skip
    tokens = json.loads(lines["TOKENS"]) if "TOKENS" in lines else None
    report = json.loads(lines["NPU"]) if "NPU" in lines else None
    return done.returncode, tokens, report, output


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """The tiny Llama with head size 128 (GQA 4:2)."""
    return write_checkpoint("llama", tmp_path_factory.mktemp("sim") / "llama", head_dim=128)


def check_graph_counters(report: dict, mode: str) -> None:
    """Eager runs capture and replay nothing; graph runs capture, replay (aten ops too) and
    update their tasks, with no synchronize inside a replayed step."""
    if mode == "eager":
        assert report["graphs_captured"] == 0 and report["replays"] == 0, report
        return
    assert report["graphs_captured"] > 0, report
    assert report["replays"] > 0 and report["task_updates"] > 0, report
    assert report["replayed_ops"] > report["replays"], report  # aten ops replay too
    assert report["synchronizes"] == 0, report


def _check_graph_run(report: dict, mode: str) -> None:
    calls = report["torch_npu_calls"]
    assert calls.get("npu_fused_infer_attention_score.out", 0) > 0, report
    assert calls.get("npu_scatter_pa_kv_cache", 0) > 0, report
    assert report["cached_tokens"][6] >= 2 * 128, report  # the prefix-cache hit
    check_graph_counters(report, mode)


@pytest.mark.parametrize("mode", ["eager", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_simulated_npu_gives_transformers_tokens(llama, runner, mode, tmp_path) -> None:
    status, tokens, report, output = run_simulated(llama, runner, mode, tmp_path)
    assert status == 0, output[-4000:]
    assert_transformers_tokens(llama, PROMPTS, tokens)
    _check_graph_run(report, mode)
    assert report["model_runner"] == ("HostModelRunner" if runner == "v1" else "HostModelRunnerV2")


def test_sliding_window_on_the_simulated_npu(tmp_path_factory, tmp_path) -> None:
    """A Mistral whose every layer attends through a 48-token window (the fused op's
    band mode), FULL_DECODE_ONLY graphs: transformers' float16 tokens."""
    import transformers

    path = tmp_path_factory.mktemp("sim") / "mistral"
    config = transformers.MistralConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=1024, initializer_range=0.15, tie_word_embeddings=False,
        sliding_window=WINDOW,
    )  # fmt: skip
    torch.manual_seed(1234)
    transformers.MistralForCausalLM(config).save_pretrained(path)
    status, tokens, report, output = run_simulated(path, "v1", "FULL_DECODE_ONLY", tmp_path)
    assert status == 0, output[-4000:]
    assert_transformers_tokens(path, PROMPTS, tokens)
    _check_graph_run(report, "FULL_DECODE_ONLY")


FAULT_PROMPTS = PROMPTS[:3]
# fault -> (model runner, what the simulation says). A replay waits for its update only
# where the update follows the launch (V2's order; V1 updates before replaying).
CAUGHT = {
    "copy_in_task": ("v1", "aten.clone.default issued inside a task update"),
    "moved_tensor": ("v1", "argument 'block_table' is"),
    "sync_while_replay_waits": ("v2", "torch.npu.synchronize with a replay held"),
    "stream_budget": ("v1", "error 207005"),
}


@pytest.mark.parametrize("fault", sorted(CAUGHT))
def test_deliberate_faults_are_refused(llama, fault, tmp_path) -> None:
    runner, message = CAUGHT[fault]
    status, tokens, _, output = run_simulated(
        llama, runner, "FULL_DECODE_ONLY", tmp_path, FAULT_PROMPTS, fault=fault
    )
    assert status != 0 and tokens is None, output[-4000:]
    assert message in output, output[-4000:]


def test_skipped_task_update_gives_other_tokens(llama, tmp_path) -> None:
    """Replays whose attention tasks keep their captured plans: the run completes (the
    protocol is kept: each replay's tasks are released) but its tokens are wrong."""
    status, tokens, report, output = run_simulated(
        llama, "v1", "FULL_DECODE_ONLY", tmp_path, FAULT_PROMPTS, fault="skip_task_update"
    )
    assert status == 0, output[-4000:]
    assert report["replays"] > 0 and report["task_updates"] == 0, report
    assert max(argmax_gaps(llama, FAULT_PROMPTS, tokens)) > 10 * TIE_TOLERANCE
