"""Speculative decoding with EAGLE, MTP and ngram on vLLM's Model Runner V2 in host mode
(``VLLM_USE_V2_MODEL_RUNNER=1``), eager and with the drafter's own FULL graphs captured
by npu-graphs (V2's ``SpeculatorCudaGraphManager`` replaced by the bridge's).

Greedy tokens with speculation must equal those without it, on V2 and on V1: rejection
sampling keeps exactly the target's greedy tokens, whatever the drafter proposes. That
alone cannot see a wrong drafter graph (the random-weight drafters here are seldom
right anyway), so the drafts themselves are compared: with graphs, every proposal must
hold the tokens the eager drafter proposed at the same step. A drafter whose replays
skip their task update must propose other drafts (its graphs then attend with the
captured dummy step's plans), while the greedy tokens stay the target's.

The drafters (``test_spec_decode.py``'s checkpoints) draft ``k = 2`` tokens:

* an EAGLE head for the tiny Llama, and the MTP layer of a tiny DeepSeek-V3 (MLA
  attention) drafting both tokens (vLLM's ``target_dependent_ar`` drafters): a draft
  prefill over the verify step's ``1 + k`` tokens per request and one draft step of one
  token per request, each replaying graphs of its own under FULL_DECODE_ONLY;
* ``mtp2``: the same DeepSeek-V3 with two MTP layers (vLLM's multi-module MTP), both
  modules in one graph per verify batch size.

The MTP layer also runs under FULL_AND_PIECEWISE (compiled, as vLLM compiles the
drafter with the target), where mixed batches replay PIECEWISE pieces.

ngram (V2's ``NgramGPUSpeculator``, its two kernels in PyTorch through the bridge) on the
tiny Llama, eager and FULL_DECODE_ONLY (it has no graphs of its own; verify steps
replay the target's): each proposal must hold the drafts of the rule (the rightmost
longest match, the last sampled token where none), and some must be accepted. V2's
ngram drafts for every request at every decode step (the fallback included), so every
decode step verifies ``k`` drafts per request. The random Llama seldom repeats what it
has seen, so one prompt is a run of the token it repeats (acceptances), beside two
prompts holding the whole vocabulary (a match at every step, mostly rejected) and a
short one.

The target's graphs are captured at first use (host mode's default); the drafter's at
start-up.

All V2 engines run one after another in one subprocess (``v2_spec_runner.py``), the V1
references in another (``spec_runner.py``).
"""

from __future__ import annotations

import random

import pytest
import test_spec_decode
from draft_checkpoints import write_eagle_draft
from mla_checkpoints import write_mtp_checkpoint
from test_spec_decode import run_engines

V2_RUNNER = test_spec_decode.RUNNER.with_name("v2_spec_runner.py")
V2_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
K = 2  # draft tokens per proposal: the draft prefill, then one draft step
CAPTURE_SIZES = [3, 6, 12]  # verify batches of 1, 2 and 4 requests of 1 + k tokens
# The drafter's graphs: draft prefills of 3, 6 and 12 tokens; draft steps of 3 requests
# (the one size of one token per request up to max_num_seqs = 4). Multi-module MTP: one
# graph per verify batch size.
DRAFT_GRAPHS = {"eagle": 4, "mtp": 4, "mtp2": 3}
METHODS = tuple(DRAFT_GRAPHS)
TARGETS = {"eagle": "llama", "mtp": "mtp", "mtp2": "mtp"}  # the MTP layers: same target
MODES = ("eager", "FULL_DECODE_ONLY")
# And the MTP layer under FULL_AND_PIECEWISE: vLLM compiles the drafter as the target, so
# draft prefills of mixed batches replay its pieces (the bridge's).
RUNS = [(method, mode) for method in METHODS for mode in MODES] + [("mtp", "FULL_AND_PIECEWISE")]
NGRAM = {
    "method": "ngram",  # V2 runs "ngram" and "ngram_gpu" alike (the bridge accepts "ngram")
    "num_speculative_tokens": K,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 2,
}
REPEATED_TOKEN = 335  # the tiny Llama (checkpoints.py) answers eight of it with more of it


def _graphs(graph_mode: str, **compilation) -> dict:
    if graph_mode == "eager":
        return dict(enforce_eager=True, compilation_config=compilation)
    compilation.update(cudagraph_mode=graph_mode, cudagraph_capture_sizes=CAPTURE_SIZES)
    return dict(enforce_eager=False, compilation_config=compilation)


def _compiled(mode: str) -> dict:
    return {"mode": "VLLM_COMPILE"} if mode == "FULL_AND_PIECEWISE" else {}


def _eagle(draft) -> dict:
    return {"method": "eagle", "model": str(draft), "num_speculative_tokens": K}


MTP = {"method": "mtp", "num_speculative_tokens": K}


def _ngram_prompts() -> dict:
    """Two prompts of the whole vocabulary, a run of ``REPEATED_TOKEN``, a short one."""
    prompts = test_spec_decode._prompts()
    return {
        "prompts": [*prompts[:2], [REPEATED_TOKEN] * 8, prompts[3]],
        "max_tokens": [12, 9, 12, 4],
    }


def _mtp_engine(model, mode: str, **options) -> dict:
    rng = random.Random(3)
    prompts = [
        [rng.randrange(3, 512) for _ in range(n)] for n in test_spec_decode.MTP_PROMPT_LENGTHS
    ]
    return {
        **test_spec_decode.MTP_ENGINE,
        # As test_spec_decode's MTP engines (and compiled for PIECEWISE pieces).
        **_graphs(mode, custom_ops=["none"], **_compiled(mode)),
        "model": str(model),
        "prompts": prompts,
        "max_tokens": test_spec_decode.MTP_MAX_TOKENS,
        **options,
    }


@pytest.fixture(scope="module")
def results(checkpoints, tmp_path_factory) -> dict[str, dict]:
    """Every engine's result by name: ``{v1,v2}-{llama,llama-ngram,mtp}`` without
    speculation, ``{eagle,mtp,mtp2,ngram}-{mode}``, ``mtp-FULL_AND_PIECEWISE`` and
    ``eagle-stale`` on V2."""
    root = tmp_path_factory.mktemp("v2-spec-decode")
    target = checkpoints["llama"]
    draft = write_eagle_draft(target, root / "eagle-draft")
    mtp_model = write_mtp_checkpoint(root / "deepseek-v3-mtp")
    mtp2_model = write_mtp_checkpoint(root / "deepseek-v3-mtp2", num_mtp_layers=2)
    engine = test_spec_decode.ENGINE
    references = {
        "llama": {**engine, **_graphs("eager")},
        "mtp": _mtp_engine(mtp_model, "eager"),
        "llama-ngram": {**engine, **_graphs("eager"), **_ngram_prompts()},
    }
    v2_engines = {f"v2-{name}": options for name, options in references.items()}
    for mode in MODES:
        v2_engines[f"eagle-{mode}"] = {
            **engine,
            **_graphs(mode),
            "speculative_config": _eagle(draft),
        }
        v2_engines[f"mtp-{mode}"] = _mtp_engine(mtp_model, mode, speculative_config=MTP)
        v2_engines[f"mtp2-{mode}"] = _mtp_engine(mtp2_model, mode, speculative_config=MTP)
        v2_engines[f"ngram-{mode}"] = {
            **engine,
            **_graphs(mode),
            **_ngram_prompts(),
            "speculative_config": NGRAM,
        }
    v2_engines["mtp-FULL_AND_PIECEWISE"] = _mtp_engine(
        mtp_model, "FULL_AND_PIECEWISE", speculative_config=MTP
    )
    v2_engines["eagle-stale"] = {
        **v2_engines["eagle-FULL_DECODE_ONLY"],
        "skip_draft_updates": True,
    }
    prompts, max_tokens = test_spec_decode._prompts(), test_spec_decode.MAX_TOKENS
    v2 = run_engines(
        target, prompts, max_tokens, v2_engines, root / "v2.json",
        runner=V2_RUNNER, env=V2_ENV, capture_on_first_use=True,
    )  # fmt: skip
    v1_engines = {f"v1-{name}": options for name, options in references.items()}
    v1 = run_engines(target, prompts, max_tokens, v1_engines, root / "v1.json")
    return {**v1, **v2}


def _check_ran_on_v2(result: dict) -> None:
    assert "error" not in result, result["error"]
    assert result["model_runners"] == ["HostModelRunnerV2"], result["model_runners"]


@pytest.mark.parametrize("model", ["llama", "mtp", "llama-ngram"])
def test_v2_without_speculation_equals_v1(results, model):
    v1, v2 = results[f"v1-{model}"], results[f"v2-{model}"]
    assert "error" not in v1, v1["error"]
    _check_ran_on_v2(v2)
    assert v2["tokens"] == v1["tokens"]
    assert all(v2["tokens"]), v2["tokens"]


@pytest.mark.parametrize(("method", "mode"), RUNS)
def test_speculation_keeps_greedy_tokens(results, method, mode):
    result = results[f"{method}-{mode}"]
    _check_ran_on_v2(result)
    model = TARGETS[method]
    stats, counters = result["spec"], result["counters"]
    print(
        f"\n{method} {mode} on V2: drafts {stats['num_drafts']}, draft tokens "
        f"{stats['num_draft_tokens']}, accepted {stats['num_accepted_tokens']}; "
        f"graph counters {counters}"
    )
    for i, (ours, theirs) in enumerate(zip(result["tokens"], results[f"v1-{model}"]["tokens"])):
        assert ours == theirs, f"prompt {i}: with {method} on V2 {ours} != V1 without {theirs}"
    assert result["tokens"] == results[f"v2-{model}"]["tokens"]
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] == K * stats["num_drafts"]
    assert result["drafts"] and all(len(row) == K for step in result["drafts"] for row in step)
    if mode == "eager":
        assert counters["captured"] == counters["draft_captured"] == 0, counters
        assert counters["draft_replayed_steps"] == 0, counters
        return
    # Verify steps replayed the target's graphs, draft passes the drafter's, each after
    # a task update; drafter passes off its graphs (after prefills) dispatched apart.
    assert counters["task_updates"] == counters["replayed_steps"] > 0, counters
    assert counters["draft_captured"] == DRAFT_GRAPHS[method], counters
    assert counters["draft_task_updates"] == counters["draft_replayed_steps"] > 0, counters
    assert counters["draft_other_forwards"] > 0, counters
    if mode == "FULL_AND_PIECEWISE":  # mixed steps of the target or drafter: pieces
        assert counters["replayed_pieces"] > 0, counters
    # The graphs drafted what the eager drafter drafted, proposal by proposal.
    assert result["drafts"] == results[f"{method}-eager"]["drafts"]


def test_draft_replays_without_task_update_draft_otherwise(results):
    """The EAGLE drafter's replays skip their task update: its graphs attend with the
    captured dummy step's plans, so its drafts differ from the eager drafter's; the
    greedy tokens stay the target's."""
    result, eager = results["eagle-stale"], results["eagle-eager"]
    _check_ran_on_v2(result)
    counters = result["counters"]
    assert result["skipped_draft_updates"] == counters["draft_replayed_steps"] > 0, result
    assert result["tokens"] == results["v2-llama"]["tokens"]
    assert len(result["drafts"]) == len(eager["drafts"])
    assert result["drafts"] != eager["drafts"], "stale draft replays drafted the same tokens"


@pytest.mark.parametrize("mode", MODES)
def test_ngram_keeps_greedy_tokens_and_accepts_drafts(results, mode):
    """V2's ngram drafter: the greedy tokens of V2 and V1 without speculation; every
    proposal the rule's drafts; drafts accepted (the repeated token's run) and
    rejected; with FULL_DECODE_ONLY, verify steps replay the target's graphs (the
    drafter has none) and the drafts are the eager run's."""
    result = results[f"ngram-{mode}"]
    _check_ran_on_v2(result)
    stats, counters = result["spec"], result["counters"]
    print(
        f"\nngram {mode} on V2: drafts {stats['num_drafts']}, draft tokens "
        f"{stats['num_draft_tokens']}, accepted {stats['num_accepted_tokens']} "
        f"(per position {stats['accepted_per_position']}); graph counters {counters}"
    )
    reference = results["v1-llama-ngram"]["tokens"]
    for i, (ours, theirs) in enumerate(zip(result["tokens"], reference)):
        assert ours == theirs, f"prompt {i}: with ngram on V2 {ours} != V1 without {theirs}"
    assert result["tokens"] == results["v2-llama-ngram"]["tokens"]
    assert result["tokens"][2] == [REPEATED_TOKEN] * 12, "the Llama no longer repeats its token"
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] == K * stats["num_drafts"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert all(stats["accepted_per_position"]), stats
    assert result["drafts"] and all(len(row) == K for step in result["drafts"] for row in step)
    assert result["drafts"] == result["rule_drafts"]
    if mode == "eager":
        assert counters["captured"] == counters["replayed_steps"] == 0, counters
        return
    assert counters["task_updates"] == counters["replayed_steps"] > 0, counters
    assert counters["draft_captured"] == counters["draft_replayed_steps"] == 0, counters
    assert result["drafts"] == results["ngram-eager"]["drafts"]
