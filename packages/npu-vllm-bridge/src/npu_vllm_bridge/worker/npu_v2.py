"""NPU model runner on vLLM's Model Runner V2: its ``GPUModelRunner`` with npu-graphs graphs.

The NPU worker (``npu.py``) builds it when vLLM selected Model Runner V2 (Triton is
available, as triton-ascend is on an NPU, or ``VLLM_USE_V2_MODEL_RUNNER=1``). vLLM's V2
runner calls ``torch.cuda``; the worker points those names at ``torch.npu``
(``route_cuda_to_npu``). Its graph manager is the bridge's, through the hook host mode's
V2 runner shares (``graphs/v2_runner.py``), on npu-graphs' ``npu`` backend (the NPU
platform's settings): each FULL replay is launched before its attention tasks' update,
which runs on the backend's update stream and releases each task by its ExternalEvent.

Written against vLLM 0.32's V2 ``GPUModelRunner`` and torch_npu's published API; it has
not run on NPU hardware. Its torch_npu calls under V2's graph manager (capture, task
groups, replay, update order) are checked by ``tests-conformance/test_npu_v2_graphs.py``.
"""

from __future__ import annotations

from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2

from npu_vllm_bridge.worker.bridge_runner import BridgeModelRunnerV2


class NPUModelRunnerV2(BridgeModelRunnerV2, GPUModelRunnerV2):
    """vLLM's V2 ``GPUModelRunner`` whose graphs are npu-graphs NPU graphs, with what the
    bridge's V2 runners add (``bridge_runner.py``)."""
