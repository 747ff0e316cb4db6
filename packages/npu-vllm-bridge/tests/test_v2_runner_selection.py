"""Which model runner the bridge's workers build for the runner vLLM selected (host mode's
V1 and V2 runners are exercised in vLLM by tests-integration/)."""

from __future__ import annotations

import pytest

from npu_vllm_bridge.worker.npu import NPUWorker


def test_the_npu_worker_refuses_model_runner_v2() -> None:
    worker = NPUWorker.__new__(NPUWorker)  # no NPU here: only the runner choice
    worker.use_v2_model_runner = True
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        worker._make_model_runner()
