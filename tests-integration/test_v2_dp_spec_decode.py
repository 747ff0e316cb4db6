"""Data parallelism with an MTP drafter on vLLM's Model Runner V2 in host mode
(``VLLM_USE_V2_MODEL_RUNNER=1``), FULL_DECODE_ONLY: DeepSeek's serving configuration
(DP + MTP) on a tiny DeepSeek-V3-shaped MoE whose MTP layer is a MoE layer too, so that
the target's and the drafter's forwards both run the DP MoE collectives.

Two DP ranks (``dp_ranks.py``, one process per rank) with MTP drafting ``k = 2`` tokens
must give the greedy tokens of one rank without speculation (rejection sampling keeps the
target's greedy tokens) and of one rank with the same speculation. The ranks get prompts
of different lengths and token counts, so their batches differ and one rank idles (vLLM
runs its dummy step, the drafter included) while the other still decodes. Every step
runs the descriptor the ranks agreed on, so both ranks replay the same number of target
and drafter graphs; the drafter's graphs (captured at start-up, every descriptor on
every rank in one order) must be replayed.

The drafter's start-up capture enters vLLM's forward context, which with DP builds the
DP metadata; host mode runs that unrecorded in the drafter's captures as in the
target's (``host/runner_v2.py``), or the capture fails on a host value.

Extended (three engines, about 2 minutes on a 2-core CPU): ``nox -s integration -- -m
extended``.
"""

from __future__ import annotations

import json

import pytest
from dp_ranks import PROMPTS, by_prompt, run_rank_results
from mla_checkpoints import MLA_MOE, write_mtp_checkpoint

pytestmark = pytest.mark.extended

K = 2
# Ranks run prompts r::2: rank 0's decode for long, rank 1's stop early and it idles.
MAX_TOKENS = [16, 2, 12, 3, 8, 2, 4, 3]
CAPTURE_SIZES = [3, 6, 12]  # verify batches of 1, 2 and 4 requests of 1 + k tokens
ENGINE = dict(max_num_seqs=4, block_size=16, enable_prefix_caching=False)
EAGER = dict(enforce_eager=True, compilation_config={"custom_ops": ["none"]})
FULL = dict(
    enforce_eager=False,
    compilation_config={
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": CAPTURE_SIZES,
        "custom_ops": ["none"],  # vLLM's C++ rotary embedding differs from its torch one
    },
)
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": K}}


@pytest.fixture(scope="module")
def mtp_moe(tmp_path_factory):
    """The tiny DeepSeek-V3 MoE (``MLA_MOE``) with one MTP layer, a MoE layer as the
    target's (``write_mtp_checkpoint`` copies the last layer's weights, experts
    included; every layer stays MoE)."""
    path = write_mtp_checkpoint(tmp_path_factory.mktemp("dp-mtp") / "mtp-moe", **MLA_MOE)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["first_k_dense_replace"] = 0
    config_path.write_text(json.dumps(config, indent=1))
    return path


def test_dp2_with_mtp_in_full_graphs_equals_one_rank(mtp_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")

    def run(name: str, dp_size: int, engine: dict) -> list[dict]:
        options = {**ENGINE, **engine}
        return run_rank_results(
            mtp_moe, dp_size, tmp_path, name=name, max_tokens=MAX_TOKENS, engine=options
        )

    reference = by_prompt(run("reference", 1, EAGER), "tokens")
    assert [len(t) for t in reference] == MAX_TOKENS, reference
    one = run("dp1-mtp", 1, {**FULL, **MTP})
    two = run("dp2-mtp", 2, {**FULL, **MTP})
    for name, results in (("DP=1", one), ("DP=2", two)):
        tokens = by_prompt(results, "tokens")
        for i in range(len(PROMPTS)):
            assert tokens[i] == reference[i], (
                f"prompt {i}: {name} with MTP in FULL graphs {tokens[i]} != "
                f"one rank without speculation {reference[i]}"
            )
    counters = [r["counters"] for r in two]
    print(f"\nDP=2 + MTP FULL_DECODE_ONLY counters: {counters}")
    for rank, c in enumerate(counters):
        assert c["draft_captured"] > 0 and c["draft_replayed_steps"] > 0, (rank, c)
        assert c["replayed_steps"] > 0, (rank, c)
    for key in ("captured", "replayed_steps", "draft_captured", "draft_replayed_steps"):
        assert counters[0][key] == counters[1][key], f"{key} differs between ranks: {counters}"
