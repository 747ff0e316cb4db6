"""Host mode at vLLM's defaults: each documented configuration started with no graph,
compilation or eager flag at all (torch.compile on, vLLM's default graph mode,
FULL_AND_PIECEWISE), so that a default that breaks is caught. Other tests choose their
graph modes; this one leaves them to vLLM.

* A data-parallel MoE server (``docs/serving.md``): a DP=2 OpenAI-compatible server on
  the tiny random Qwen3-MoE (``dp_ranks.py``, a word-level tokenizer), with and without
  ``--enable-dbo`` (low split thresholds, so decode steps split), eight concurrent greedy
  completions. Reference: transformers' greedy tokens, which one DP rank gives
  (``test_data_parallel_moe.py`` checks DP=2 against DP=1 eagerly). Each rank must
  report steps run with graphs, and with DBO split steps with hand-overs. On a vLLM
  built without ``vllm._C`` the experts run as host mode's PyTorch versions of vLLM's
  CPU MoE kernels (``host/moe_ops.py``).
* Offline engines on both model runners (``VLLM_USE_V2_MODEL_RUNNER=0`` and ``1``),
  one subprocess per runner: the tiny DeepSeek-V3-shaped MLA model, the tiny Llama
  with an EAGLE head and the DeepSeek-V3 with one MTP layer (``k = 2``). Reference:
  transformers' greedy tokens (speculation keeps the target's greedy tokens). On a vLLM
  built without ``vllm._C`` V1's speculative-decoding kernels run as host mode's PyTorch
  versions (``host/spec_ops.py``).

SmolLM2's server at vLLM's defaults is ``test_serving.py``'s. Engines keep vLLM's
defaults but for the dtype (float32, as transformers), lengths and a fixed KV cache
(``kv_cache_memory_bytes``: the machine is shared).
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import test_spec_decode
from checkpoints import hf_greedy, write_checkpoint, write_word_tokenizer
from dp_ranks import PROMPTS, write_tiny_moe
from draft_checkpoints import write_eagle_draft
from mla_checkpoints import write_mla_checkpoint, write_mtp_checkpoint
from servers import Server, serve
from test_spec_decode import run_engines

from npu_vllm_bridge.graphs.counters import COUNTERS_DIR_ENV

DP_MAX_TOKENS = 12
VOCAB_SIZE = 512
KV_CACHE_BYTES = 64 * 2**20
DP_SERVER = [
    "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
    "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--seed", "0",
    "--data-parallel-size", "2",
]  # fmt: skip
DBO = ["--enable-dbo", "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "4"]
MOE_LAYERS = 2

ENGINE = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0)
K = 2  # draft tokens per proposal
MLA_LENGTHS, MLA_MAX_TOKENS = (9, 40, 70), [8, 6, 4]
RUNNERS = {"v1": "0", "v2": "1"}  # VLLM_USE_V2_MODEL_RUNNER
V2_SPEC_RUNNER = test_spec_decode.RUNNER.with_name("v2_spec_runner.py")  # reports runners


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """The Qwen3-MoE with a word tokenizer, and transformers' greedy tokens for ``PROMPTS``."""
    path = write_tiny_moe(tmp_path_factory.mktemp("defaults-moe") / "tiny-qwen3-moe")
    write_word_tokenizer(path, VOCAB_SIZE)
    return path, hf_greedy(path, PROMPTS, [DP_MAX_TOKENS] * len(PROMPTS))


def _complete(server: Server, prompt: list[int]) -> list[int]:
    body = {
        "model": server.model,
        "prompt": " ".join(f"t{token}" for token in prompt),
        "max_tokens": DP_MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, reply = server.post("/v1/completions", json.dumps(body).encode())
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["prompt_token_ids"] == prompt, choice
    return choice["token_ids"]


@pytest.mark.parametrize("dbo", [False, True], ids=["plain", "dbo"])
def test_dp_moe_server_at_defaults(tiny_moe, tmp_path, dbo):
    model, expected = tiny_moe
    counters_dir = tmp_path / "counters"
    counters_dir.mkdir()
    args = DP_SERVER + (DBO if dbo else [])
    with (
        serve(
            model, args, tmp_path / "server.log", {COUNTERS_DIR_ENV: str(counters_dir)}
        ) as server,
        ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool,
    ):
        served = list(pool.map(lambda prompt: _complete(server, prompt), PROMPTS))
        log = server.log.read_text(errors="replace")
    for index, (ours, theirs) in enumerate(zip(served, expected)):
        assert ours == theirs, f"prompt {index}: DP=2 server {ours} != transformers {theirs}"
    assert "FULL_AND_PIECEWISE graph keys are captured at their first step" in log, log[-4000:]
    assert "Starting torch.compile" in log, log[-4000:]
    ranks = {
        path.name: json.loads(path.read_text()) for path in counters_dir.glob("dp*-rank0.json")
    }
    assert sorted(ranks) == ["dp0-rank0.json", "dp1-rank0.json"], ranks
    for name, c in ranks.items():
        summary = f"{name}: {c}"
        assert c["captured"] + c["split_captured"] >= 1, summary  # graphs ran
        if dbo:
            # Decode steps split; a prefill splits only when both ranks' prefills meet in
            # one step (test_micro_batch_overlap.py sends rounds until they do).
            assert c["split_decode_steps"] >= 1, summary
            assert c["yields_per_split_forward"] == 2 * 2 * MOE_LAYERS, summary
        else:
            assert c["split_steps"] == 0, summary


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Each offline configuration's checkpoint, prompts and transformers' tokens."""
    root = tmp_path_factory.mktemp("defaults-models")
    rng = random.Random(11)
    mla = write_mla_checkpoint(root / "deepseek-v3-tiny")
    mla_prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in MLA_LENGTHS]
    llama = write_checkpoint("llama", root / "llama")
    draft = write_eagle_draft(llama, root / "eagle-draft")
    llama_prompts = test_spec_decode._prompts()
    mtp = write_mtp_checkpoint(root / "deepseek-v3-mtp")
    mtp_prompts = [
        [rng.randrange(3, 512) for _ in range(n)] for n in test_spec_decode.MTP_PROMPT_LENGTHS
    ]
    configs = {
        "mla": (mla, mla_prompts, MLA_MAX_TOKENS, {}),
        "eagle": (
            llama,
            llama_prompts,
            test_spec_decode.MAX_TOKENS,
            {"method": "eagle", "model": str(draft), "num_speculative_tokens": K},
        ),
        "mtp": (
            mtp,
            mtp_prompts,
            test_spec_decode.MTP_MAX_TOKENS,
            {"method": "mtp", "num_speculative_tokens": K},
        ),
    }
    return {
        name: {
            "engine": {
                **ENGINE,
                "model": str(path),
                "prompts": prompts,
                "max_tokens": max_tokens,
                **({"speculative_config": speculative} if speculative else {}),
            },
            "expected": hf_greedy(path, prompts, max_tokens),
        }
        for name, (path, prompts, max_tokens, speculative) in configs.items()
    }


@pytest.fixture(scope="module", params=list(RUNNERS))
def runner_results(request, models, tmp_path_factory) -> tuple[str, dict[str, dict]]:
    """Every offline configuration on one model runner, one after another in one
    subprocess (host mode's defaults: graphs captured at their first step)."""
    runner = request.param
    engines = {name: config["engine"] for name, config in models.items()}
    first = engines["mla"]
    results = run_engines(
        Path(first["model"]),
        first["prompts"],
        first["max_tokens"],
        engines,
        tmp_path_factory.mktemp(f"defaults-{runner}") / "spec.json",
        runner=V2_SPEC_RUNNER,
        env={"VLLM_USE_V2_MODEL_RUNNER": RUNNERS[runner]},
        capture_on_first_use=True,
    )
    return runner, results


@pytest.mark.parametrize("name", ["mla", "eagle", "mtp"])
def test_offline_engine_at_defaults(runner_results, models, name):
    runner, results = runner_results
    result = results[name]
    assert "error" not in result, result["error"]
    for index, (ours, theirs) in enumerate(zip(result["tokens"], models[name]["expected"])):
        assert ours == theirs, f"{runner} {name}, prompt {index}: {ours} != transformers {theirs}"
    expected_runner = "HostModelRunnerV2" if runner == "v2" else "HostModelRunner"
    assert result["model_runners"] == [expected_runner], result["model_runners"]
    counters = result["counters"]
    assert counters["captured"] >= 1, counters  # vLLM's default graphs ran
    if name != "mla":
        stats = result["spec"]
        assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] > 0, stats
        assert result["states"].get("SPEC_DECODING", 0) > 0, result["states"]
