"""Triton kernels of the ``triton`` provider: KV-cache write and paged attention.

Every kernel reads its per-step arguments (slot mapping, query offsets, sequence
lengths, block tables) from device tensors, and its grid depends only on tensor
shapes, so a launch can be captured in a device graph and replayed after the
step tensors are refreshed in place. The portable kernels use CUDA-only features
(PTX prefetch hints, programmatic dependent launch) only behind checks of the device; ``hopper_prefill.py``, ``hopper_decode.py`` and
``hopper_mla_decode.py`` are Gluon kernels for Hopper GPUs, imported by the providers
only where they can run.
"""

from npu_attention.providers.triton_kernels.cache_write import write_kv_cache
from npu_attention.providers.triton_kernels.paged_attention import (
    AttentionLaunchConfig,
    paged_attention,
)

__all__ = ["AttentionLaunchConfig", "paged_attention", "write_kv_cache"]
