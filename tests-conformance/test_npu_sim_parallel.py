"""Parallel vLLM runs on the simulated NPU (``npu_sim.py``), and the NPU platform's
device communicator inside simulated graphs.

The simulation reaches every process of a run: the worker processes of vLLM's
multiprocessing executor (tensor and decode-context parallel ranks) through
``npu_sim_site``'s ``sitecustomize``, and one engine process per data-parallel rank
(``--data-parallel-size``), each of which reports its own NPU counters; the ``NPU`` line
sums them and keeps each under ``ranks``. vLLM's process groups talk through the NPU
platform's communicator (``worker/npu_communicator.py``) over gloo, and a collective
called during a capture is one task of the simulated graph (as torch_npu captures an
HCCL collective), which each replay runs again.

- The communicator's ``all_gatherv`` / ``reduce_scatterv`` / ``all_reduce`` captured in a
  simulated ``NPUGraph`` on two gloo ranks and replayed on new inputs give the sums and
  concatenations of the replay's inputs (reference: the same arithmetic on the ranks'
  known inputs).
- A DP=2 tiny Qwen3-MoE with micro-batch overlap (DBO) and FULL_DECODE_ONLY graphs in
  float16: every token is transformers' float32 argmax given the run's tokens before it,
  within ``TIE_TOLERANCE`` in logit (``test_npu_sim_engine``'s check); each rank captures
  micro-batched graphs and replays them with per-micro-batch task updates, the MoE's
  all-gathers and reduce-scatters run through the NPU communicator, in graphs too, and no
  step that replays a graph synchronizes.
- By hand (``NPU_SIM_BY_HAND=1``; minutes each on 2 cores, see the README): TP=2 on the
  tiny Llama (FULL_DECODE_ONLY); MLA with DCP=2 (TP=2) on a tiny DeepSeek-shaped model,
  V1 and V2, eager and FULL_DECODE_ONLY.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests-integration"))

from communicator_sim_ranks import SIZES, communicator_rank, rank_rows  # noqa: E402
from test_npu_sim_engine import RUNNER, TIE_TOLERANCE, argmax_gaps  # noqa: E402

BY_HAND = pytest.mark.skipif(
    os.environ.get("NPU_SIM_BY_HAND") != "1", reason="minutes on 2 cores: NPU_SIM_BY_HAND=1"
)
TIMEOUT_S = 1200
DBO_ARGS = [
    "--data-parallel-size", "2", "--enable-dbo",
    "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "4",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the NPU communicator in a simulated graph --------------------------------------
def test_npu_communicator_collectives_replay_in_a_simulated_graph(torch_npu_api):
    """Captured once on step 0's inputs, replayed on steps 1 and 2: each replay's
    collectives read that step's inputs."""
    from npu_sim_install import wheel_dir  # where the fixture has the wheel

    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), _free_port()
    ranks = [
        context.Process(target=communicator_rank, args=(rank, port, str(wheel_dir()), results))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        answers = dict((rank, rest) for rank, *rest in (results.get(timeout=300) for _ in ranks))
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    for rank, (replays, captured) in answers.items():
        assert captured == 3, f"rank {rank}: {captured} collectives captured"
        for step, answers_of_step in zip((1, 2), replays):
            gathered, scattered, summed = (
                torch.tensor(a, dtype=torch.float16) for a in answers_of_step
            )
            both = torch.cat([rank_rows(r, step) for r in range(2)])
            assert torch.equal(gathered, both), (rank, step, gathered)
            start = sum(SIZES[:rank])
            assert torch.equal(scattered, 2 * both[start : start + SIZES[rank]]), (rank, step)
            rows = min(SIZES)
            expected = rank_rows(0, step)[:rows] + rank_rows(1, step)[:rows]
            assert torch.equal(summed, expected), (rank, step, summed)


# -- engine runs -------------------------------------------------------------------
def run_parallel(
    model: Path, prompts: list[list[int]], max_tokens: int, tmp_path: Path, args: list[str],
    runner: str = "v1",
) -> tuple[int, list[list[int]] | None, dict | None, str]:  # fmt: skip
    """One ``npu_sim.py`` run in float16 (its own process group, stopped by id if it
    outlives ``TIMEOUT_S``): (exit status, tokens, NPU report, output)."""
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    command = [
        sys.executable, str(RUNNER), "--model", str(model), "--runner", runner,
        "--dtype", "float16", "--prompts", str(prompts_file), "--max-tokens", str(max_tokens),
        "--kv-cache-bytes", str(64 * 2**20), *args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the host platform splits the CPUs
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in output.splitlines()
             if line.startswith(("TOKENS ", "NPU "))}  # fmt: skip
    tokens = json.loads(lines["TOKENS"]) if "TOKENS" in lines else None
    report = json.loads(lines["NPU"]) if "NPU" in lines else None
    return proc.returncode, tokens, report, output


def assert_transformers_argmax(model: Path, prompts, tokens, max_tokens: int) -> None:
    assert tokens is not None and [len(t) for t in tokens] == [max_tokens] * len(prompts)
    gaps = argmax_gaps(model, prompts, tokens)
    assert max(gaps) <= TIE_TOLERANCE, f"logit gaps to transformers' argmax: {gaps}"


def check_ranks_replayed(report: dict, ranks: int) -> None:
    """Every worker process captured, replayed and updated graphs, with no synchronize
    in a replayed step, and ran the attention ops through torch_npu."""
    assert len(report["ranks"]) == ranks, report["ranks"]
    for rank in report["ranks"]:
        summary = {k: v for k, v in rank.items() if not k.startswith("torch_npu")}
        assert rank["graphs_captured"] > 0 and rank["replays"] > 0, summary
        assert rank["task_updates"] > 0 and rank["synchronizes"] == 0, summary
        assert rank["torch_npu_calls"], summary


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    from dp_ranks import write_tiny_moe

    return write_tiny_moe(tmp_path_factory.mktemp("sim") / "tiny-qwen3-moe")


@pytest.mark.npu_sim
@pytest.mark.slow
def test_dp2_moe_with_micro_batches_in_full_graphs(tiny_moe, tmp_path):
    """On Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``, as vLLM asks for DBO there).
    Two DP ranks of a tiny Qwen3-MoE (``dp_ranks.py``: 8 experts, 2 per token), each an
    engine process with its worker process, DBO from 2 decode tokens (4 with a prefill),
    FULL_DECODE_ONLY graphs of 1 to 8 tokens, float16: transformers' tokens; each rank
    captures graphs of both micro-batches and replays every split decode step from one,
    each micro-batch's attention tasks updated with its own plan; the MoE's gathers and
    reduce-scatters run through the NPU platform's communicator, in the graphs too."""
    from dp_ranks import PROMPTS

    max_tokens = 12
    args = [
        *DBO_ARGS, "--mode", "FULL_DECODE_ONLY", "--capture-sizes", "1", "2", "3", "4", "8",
        "--max-model-len", "256",
    ]  # fmt: skip
    status, tokens, report, output = run_parallel(
        tiny_moe, PROMPTS, max_tokens, tmp_path, args, runner="v2"
    )
    assert status == 0, output[-4000:]
    assert_transformers_argmax(tiny_moe, PROMPTS, tokens, max_tokens)
    check_ranks_replayed(report, ranks=2)
    assert sorted(rank["dp_rank"] for rank in report["ranks"]) == [0, 1]
    for rank in report["ranks"]:
        calls = rank["communicator_calls"]
        assert calls.get("all_gatherv", 0) > 0 and calls.get("reduce_scatterv", 0) > 0, calls
        assert rank["replayed_collectives"] > rank["replays"], rank  # MoE collectives in graphs
    graphs = report["bridge_graphs"]  # both ranks' counts
    assert graphs["split_captured"] >= 2 and graphs["split_replayed_steps"] >= 2, graphs
    assert graphs["split_task_updates"] == graphs["split_replayed_steps"], graphs
    # Each replayed split step updates both micro-batches' task groups.
    assert report["task_updates"] >= 2 * graphs["split_replayed_steps"], report


SHORT_PROMPTS = [[(11 * i + 7 * j) % 480 + 3 for j in range(n)] for i, n in enumerate((5, 23, 150))]
GRAPH_ARGS = ["--mode", "FULL_DECODE_ONLY", "--capture-sizes", "1", "2", "4"]


@BY_HAND
@pytest.mark.npu_sim
@pytest.mark.slow
def test_tp2_on_the_simulated_npu(tmp_path_factory, tmp_path):
    """The tiny Llama (GQA 4:2, head size 128) on two TP ranks, each a worker process of
    vLLM's multiprocessing executor: transformers' tokens; every rank replays graphs
    whose all-reduces run through the NPU communicator."""
    from checkpoints import write_checkpoint

    model = write_checkpoint("llama", tmp_path_factory.mktemp("sim") / "llama", head_dim=128)
    args = [*GRAPH_ARGS, "--tensor-parallel-size", "2", "--max-model-len", "512"]
    status, tokens, report, output = run_parallel(model, SHORT_PROMPTS, 8, tmp_path, args)
    assert status == 0, output[-4000:]
    assert_transformers_argmax(model, SHORT_PROMPTS, tokens, 8)
    check_ranks_replayed(report, ranks=2)
    for rank in report["ranks"]:
        assert rank["communicator_calls"].get("all_reduce", 0) > 0, rank
        assert rank["replayed_collectives"] > 0, rank


# DeepSeek-shaped MLA the ascend MLA provider takes (the fused op's 512 + 64 latent,
# 128-wide no-rope and value heads), 16 heads: 8 a TP rank, 16 gathered under DCP.
ASCEND_MLA_SHAPE = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    num_attention_heads=16, num_key_value_heads=16,
)  # fmt: skip


@BY_HAND
@pytest.mark.npu_sim
@pytest.mark.slow
@pytest.mark.parametrize(
    ("runner", "mode"),
    [("v1", "FULL_DECODE_ONLY"), ("v1", "eager"), ("v2", "FULL_DECODE_ONLY"), ("v2", "eager")],
)
def test_mla_with_dcp2_on_the_simulated_npu(tmp_path_factory, tmp_path, runner, mode):
    """A tiny DeepSeek-shaped MLA model (``mla_checkpoints.py``) on TP=2 with DCP=2 in
    float16, the engine tests' eight prompts (5 to 300 tokens, up to three blocks), a
    256-token step budget (chunked prefill; steps of more than 128 tokens, of which each
    rank writes about half and sends the rest to the null block, more padding rows than
    it has), decode batches of 1 to 8, a two-block prefix-cache hit; eager and
    FULL_DECODE_ONLY graphs of 1 to 8 tokens: transformers' tokens. Every row is an
    absorbed decode over the rank's share of the latents (ATB's MLA with its LSE), the
    ranks' parts merged by LSE; in graphs each rank's decode tasks are updated and
    replayed with no synchronize in a replayed step."""
    from mla_checkpoints import write_mla_checkpoint
    from test_npu_sim_engine import MAX_TOKENS, PROMPTS, SHARED_PREFIX, check_graph_counters

    model = write_mla_checkpoint(tmp_path_factory.mktemp("sim") / "mla", **ASCEND_MLA_SHAPE)
    sizes = [] if mode == "eager" else ["--capture-sizes", *MLA_CAPTURE_SIZES]
    args = ["--mode", mode, *sizes, *MLA_DCP_ARGS]
    status, tokens, report, output = run_parallel(
        model, PROMPTS, MAX_TOKENS, tmp_path, args, runner=runner
    )
    assert status == 0, output[-4000:]
    assert_transformers_argmax(model, PROMPTS, tokens, MAX_TOKENS)
    assert len(report["ranks"]) == 2, report["ranks"]
    counters = ("graphs_captured", "replays", "task_updates", "synchronizes", "torch_npu_calls")
    print(runner, mode, [{k: rank[k] for k in counters} for rank in report["ranks"]])
    for rank in report["ranks"]:
        check_graph_counters(rank, mode)
        calls = rank["torch_npu_calls"]
        assert any(name.startswith("atb.npu_multi_head_latent_attention") for name in calls)
        assert calls.get("npu_scatter_pa_kv_cache", 0) > 0, calls
    assert report["cached_tokens"][6] >= SHARED_PREFIX, report["cached_tokens"]
    runner_class = "HostModelRunner" if runner == "v1" else "HostModelRunnerV2"
    assert report["model_runner"] == runner_class, report["model_runner"]


MLA_CAPTURE_SIZES = ["1", "2", "4", "8"]
MLA_DCP_ARGS = [
    "--tensor-parallel-size", "2", "--decode-context-parallel-size", "2",
    "--max-num-seqs", "8", "--max-model-len", "512", "--max-num-batched-tokens", "256",
]  # fmt: skip
