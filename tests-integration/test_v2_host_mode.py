"""Host mode on vLLM's Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``: its CPU runner,
vLLM's per-step Triton kernels through the bridge's PyTorch versions, the rest under
Triton's interpreter), with SmolLM2-135M-Instruct at ``max_model_len=2048``,
``max_num_seqs=16``.

The chat answers, eager, with FULL_DECODE_ONLY graphs captured by the bridge's V2 graph
manager and with FULL_AND_PIECEWISE (PIECEWISE pieces from vLLM's compile path), must
equal those of vLLM's own CPU backend on V1 and of transformers (the ``smollm2_chat``
fixture). A run whose FULL replays skip their task update must
answer differently: the check sees a stale plan. The tiny DeepSeek-V3-shaped MLA model
must equal transformers in each mode, alone and with prefill context parallelism over
two ranks (PCP=2); a Llama-shaped model too over two tensor-parallel ranks (TP=2).
"""

from __future__ import annotations

from pathlib import Path

import engines
import pytest
import test_mla
import test_tensor_parallel
from engines import REAL_MODEL_ENGINE, run_engine
from test_mla import mla_model  # noqa: F401  (fixture)
from test_refusals import _refusal
from test_smollm2_chat import GRAPH_MODES
from test_tensor_parallel import tp_model  # noqa: F401  (fixture)

V2_RUNNER = Path(__file__).with_name("v2_runner.py")


@pytest.fixture
def v2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines on Model Runner V2, started by ``v2_runner.py``."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr(engines, "RUNNER", V2_RUNNER)


@pytest.mark.parametrize("mode", ["eager", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_chat_answers_equal_v1_cpu_attn_and_transformers(v2, smollm2, smollm2_chat, tmp_path, mode):
    rounds, hf = smollm2_chat
    result = run_engine(
        smollm2, rounds, bridge=True, tmp_path=tmp_path, **REAL_MODEL_ENGINE, **GRAPH_MODES[mode]
    )
    assert result["model_runners"] == ["HostModelRunnerV2"], result
    assert result["tokens"] == [hf], "V2's answers differ from transformers' and CPU_ATTN's"
    counters = result["counters"]
    replays = counters["replayed_steps"]
    if mode == "eager":
        assert counters["captured"] == replays == 0, counters
    else:
        assert counters["captured"] == result["vllm_cudagraph_captured"] > 0, result
        assert counters["task_updates"] == replays > 0, counters


def test_full_replays_without_task_update_answer_differently(
    v2, monkeypatch, smollm2, smollm2_chat, tmp_path
):
    rounds, hf = smollm2_chat
    monkeypatch.setenv("NPU_BRIDGE_TEST_SKIP_TASK_UPDATES", "1")
    result = run_engine(
        smollm2, [rounds[0][:4]], bridge=True, tmp_path=tmp_path, **REAL_MODEL_ENGINE,
        **GRAPH_MODES["FULL_DECODE_ONLY"],
    )  # fmt: skip
    assert result["skipped_task_updates"] > 0, result
    assert result["tokens"][0] != hf[:4], "replays with stale plans gave the right answers"


def _mla_graph_options(mode: str) -> dict:
    """test_mla.py's engine options for one graph mode."""
    if mode == "eager":
        return dict(test_mla.EAGER)
    compilation = {"cudagraph_mode": mode, "cudagraph_capture_sizes": test_mla.CAPTURE_SIZES}
    if mode == "FULL_AND_PIECEWISE":
        compilation["mode"] = "VLLM_COMPILE"
    return dict(compilation_config=compilation)


@pytest.mark.parametrize("mode", ["eager", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_mla_equals_transformers(v2, mla_model, tmp_path, mode):  # noqa: F811
    """The tiny DeepSeek-V3-shaped model (test_mla.py's prompts: chunked prefill, a
    prefix-cache hit) on V2 in each graph mode."""
    model, hf = mla_model
    result = run_engine(
        model, test_mla.ROUNDS, bridge=True, tmp_path=tmp_path, **test_mla.ENGINE,
        **_mla_graph_options(mode),
    )  # fmt: skip
    assert result.get("model_runners") == ["HostModelRunnerV2"], result.get("error", result)
    test_mla._check(result, hf)
    counters = result["counters"]
    if mode != "eager":
        assert counters["task_updates"] == counters["replayed_steps"] > 0, counters


def test_tensor_parallel_equals_transformers(v2, tp_model, tmp_path):  # noqa: F811
    """Two ranks over gloo on V2 with FULL_DECODE_ONLY graphs."""
    model, hf = tp_model
    prompts, max_tokens = test_tensor_parallel.PROMPTS, test_tensor_parallel.MAX_TOKENS
    rounds = [[{"prompt": p, "max_tokens": m} for p, m in zip(prompts, max_tokens)]]
    result = run_engine(
        model, rounds, bridge=True, tmp_path=tmp_path, unset_env=("VLLM_CPU_OMP_THREADS_BIND",),
        tensor_parallel_size=2, **test_tensor_parallel.TWO_RANK_ENGINE,
        **test_tensor_parallel.GRAPH_MODES["FULL_DECODE_ONLY"],
    )  # fmt: skip
    assert "error" not in result, result["error"]
    ranks = result["rank_counters"]
    assert [rank["model_runner"] for rank in ranks] == ["HostModelRunnerV2"] * 2, ranks
    for rank in ranks:
        assert rank["counters"]["task_updates"] == rank["counters"]["replayed_steps"] > 0, rank
    assert result["tokens"] == [hf]


# FULL_AND_PIECEWISE replays the same FULL decode graphs as FULL_DECODE_ONLY, which is
# an extended variant here.
@pytest.mark.parametrize(
    "mode",
    ["eager", pytest.param("FULL_DECODE_ONLY", marks=pytest.mark.extended), "FULL_AND_PIECEWISE"],
)
def test_prefill_context_parallel_equals_one_rank_and_transformers(v2, mla_model, tmp_path, mode):  # noqa: F811
    """PCP=2 over gloo on the MLA model (vLLM 0.32 runs PCP on V2 only): each rank
    attends its DualChunkSwap chunks of every prefill and writes the latents gathered
    from both ranks. Its answers must equal transformers', which V2 with one rank gives
    (``test_mla_equals_transformers``). Before the gathered write, PCP=2 answered other
    tokens; before host graphs recorded the PCP group's all-gather, graph replays did."""
    model, hf = mla_model
    result = run_engine(
        model, test_mla.ROUNDS, bridge=True, tmp_path=tmp_path,
        unset_env=("VLLM_CPU_OMP_THREADS_BIND",), prefill_context_parallel_size=2,
        **test_mla.ENGINE, **_mla_graph_options(mode),
    )  # fmt: skip
    assert "error" not in result, result["error"]
    ranks = result["rank_counters"]
    assert [rank["model_runner"] for rank in ranks] == ["HostModelRunnerV2"] * 2, ranks
    assert [rank["pcp_world_size"] for rank in ranks] == [2, 2], ranks
    test_mla._check(result, hf)
    for rank in ranks:
        counters = rank["counters"]
        if mode != "eager":
            assert counters["task_updates"] == counters["replayed_steps"] > 0, counters


def test_prefill_context_parallel_with_speculative_decoding_is_refused(v2, mla_model, tmp_path):  # noqa: F811
    model, _ = mla_model
    error = _refusal(
        model, tmp_path, prefill_context_parallel_size=2, enforce_eager=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
    )  # fmt: skip
    assert "prefill context parallelism (prefill_context_parallel_size=2) with speculative" in error
