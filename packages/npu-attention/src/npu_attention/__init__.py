"""Paged-KV attention for LLM inference: ``plan`` once per step, ``run`` once per layer."""

from npu_attention import kv_quant
from npu_attention._version import __version__
from npu_attention.buffers import PlanBuffers
from npu_attention.context_parallel import (
    dcp_local_seq_lens,
    merge_attention_states,
    plan_context,
)
from npu_attention.kv_quant import KV_CACHE_DTYPES, KVScales
from npu_attention.mla import (
    LatentCache,
    MLASpec,
    mla_decode,
    mla_finish_decode,
    mla_prefill,
    mla_write_cache,
)
from npu_attention.plan import AttentionPlan, plan
from npu_attention.providers.base import AttentionProvider
from npu_attention.registry import (
    available_providers,
    get_provider,
    quantized_verify_in_graphs,
    register_provider,
    returns_lse,
    supported_head_sizes,
    supported_kv_cache_dtypes,
)
from npu_attention.run import run
from npu_attention.spec import (
    SUPPORTED_DTYPES,
    AttentionSpec,
    BatchState,
)

__all__ = [
    "KV_CACHE_DTYPES",
    "SUPPORTED_DTYPES",
    "AttentionPlan",
    "AttentionProvider",
    "AttentionSpec",
    "BatchState",
    "KVScales",
    "LatentCache",
    "MLASpec",
    "PlanBuffers",
    "__version__",
    "available_providers",
    "dcp_local_seq_lens",
    "get_provider",
    "kv_quant",
    "merge_attention_states",
    "mla_decode",
    "mla_finish_decode",
    "mla_prefill",
    "mla_write_cache",
    "plan",
    "plan_context",
    "quantized_verify_in_graphs",
    "register_provider",
    "returns_lse",
    "run",
    "supported_head_sizes",
    "supported_kv_cache_dtypes",
]
