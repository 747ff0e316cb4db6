"""The Ascend NPU platform (torch_npu). Written against torch_npu's and vLLM 0.32's
published APIs; it has not run on NPU hardware.

Selected when ``NPU_BRIDGE_DEVICE`` is unset/``auto`` and an NPU is usable, or with
``NPU_BRIDGE_DEVICE=npu`` (then importing this module fails, naming the cause,
when no NPU is usable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from npu_vllm_bridge.graphs.ubatch_config import hold_micro_batching
from npu_vllm_bridge.platforms import checks
from npu_vllm_bridge.platforms.common import BridgePlatformMixin
from npu_vllm_bridge.plugin import require_npu
from npu_vllm_bridge.settings import PREFIX, BridgeSettings
from npu_vllm_bridge.vllm_version import require_supported_vllm

require_supported_vllm()
require_npu()

import torch_npu  # noqa: E402, F401  (registers torch.npu and the PrivateUse1 backend)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")

NPU_WORKER = "npu_vllm_bridge.worker.npu.NPUWorker"
NPU_COMMUNICATOR = "npu_vllm_bridge.worker.npu_communicator.NPUCommunicator"
# Paged KV block size the fused attention ops take on every Ascend generation.
NPU_BLOCK_SIZE = 128


class NPUPlatform(BridgePlatformMixin, Platform):
    """vLLM platform for Ascend NPUs through npu-attention (``ascend``) and npu-graphs (``npu``)."""

    _enum = PlatformEnum.OOT
    device_name: str = "npu"
    device_type: str = "npu"
    dispatch_key: str = "PrivateUse1"
    ray_device_key: str = "NPU"
    device_control_env_var: str = "ASCEND_RT_VISIBLE_DEVICES"
    dist_backend: str = "hccl"
    simple_compile_backend: str = "eager"

    # Ascend's paged kernels take contiguous K and V caches: each layer's region holds
    # all blocks' K, then all blocks' V (see npu_vllm_bridge.attention.kv_cache).
    bridge_settings = BridgeSettings(
        attention_provider="ascend", kv_cache_split="planes", graph_backend="npu"
    )

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    # -- device ------------------------------------------------------------------------
    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.npu.get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.npu.get_device_properties(device_id).total_memory

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.npu.set_device(device)

    @classmethod
    def inference_mode(cls):
        return torch.inference_mode()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return True

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        torch.npu.reset_peak_memory_stats(device)
        return torch.npu.max_memory_allocated(device)

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"{PREFIX} runs float16 or bfloat16 models on the NPU, got {dtype}; "
                "pass dtype='bfloat16' or dtype='float16'"
            )

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        """vLLM's base communicator over HCCL with the collectives data-parallel MoE and
        micro-batch overlap need (``worker/npu_communicator.py``)."""
        return NPU_COMMUNICATOR

    @classmethod
    def import_kernels(cls) -> None:
        pass  # torch_npu is imported above; vLLM's CUDA/CPU kernels do not apply

    # -- attention and graphs ---------------------------------------------------------
    @classmethod
    def opaque_attention_op(cls) -> bool:
        return True  # attention is the split point of vLLM's piecewise compile

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        checks.check_model_and_options(vllm_config)
        _check_npu_options(vllm_config)
        hold_micro_batching(vllm_config)  # past vLLM's all-to-all check; the worker restores
        cache_config = vllm_config.cache_config
        if not cache_config.user_specified_block_size:
            cache_config.block_size = NPU_BLOCK_SIZE
        elif cache_config.block_size != NPU_BLOCK_SIZE:
            raise ValueError(
                f"{PREFIX} needs block_size={NPU_BLOCK_SIZE} on the NPU (the paged "
                f"attention kernels' page), got block_size={cache_config.block_size}; leave "
                "block_size unset or pass 128"
            )
        compilation = vllm_config.compilation_config
        if compilation.cudagraph_mode.has_piecewise_cudagraphs():
            # Dynamo splits the model at attention; pieces run eagerly inside graphs.
            compilation.backend = "eager"
        checks.apply_capture_plan(vllm_config, cls.bridge_settings.graph_backend)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = NPU_WORKER


def _check_npu_options(vllm_config: VllmConfig) -> None:
    if vllm_config.lora_config is not None:
        raise ValueError(f"{PREFIX} does not support LoRA on the NPU; remove enable_lora")
    model_config = vllm_config.model_config
    if model_config is not None and model_config.quantization is not None:
        raise ValueError(
            f"{PREFIX} does not support quantized models on the NPU "
            f"(quantization={model_config.quantization!r})"
        )
