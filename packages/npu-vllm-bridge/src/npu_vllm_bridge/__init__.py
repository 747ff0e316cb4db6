"""vLLM 0.32 plugin that runs vLLM on Ascend NPUs (or in host mode on a CPU)
through npu-attention and npu-graphs."""

from npu_vllm_bridge._version import __version__
from npu_vllm_bridge.plugin import DEVICE_ENV, platform_plugin, require_npu

__all__ = ["DEVICE_ENV", "__version__", "platform_plugin", "require_npu"]
