"""Start-up checks for context parallelism (DCP and PCP).

Decode context parallelism (``decode_context_parallel_size`` > 1) runs for GQA/MQA
models with full attention (``attention/context_parallel.py``; vLLM itself checks
the head counts: a tensor-parallel size above the KV heads) and for MLA models
(``attention/mla_context_parallel.py``) whose provider returns the log-sum-exp.
Refused here:

* prefill context parallelism: vLLM 0.32 runs it only in its V2 model runner (the
  bridge's V2 runners take it there), for MLA models: each rank holds two chunks of a
  prefill's rows (vLLM's DualChunkSwap), causal over the whole sequence, and vLLM's
  MLA layer gathers the latent rows of every rank before the cache write. The bridge's
  attention plans take a request's query rows as the last ``query_len`` positions of
  its sequence; they have no row positions of their own, so a rank's second chunk
  would see the wrong keys (on the tiny DeepSeek-V3-shaped test model, PCP=2 through
  the bridge's V2 host mode ran and answered other tokens than PCP=1 and
  transformers). ``supports_pcp`` is off on both impls;
* DCP with MLA models on a provider whose MLA decode returns no log-sum-exp (its
  class declares ``returns_lse = False``; the reference, triton and ascend MLA
  providers return it, the ascend one through ATB's MultiLatentAttention);
* DCP with speculative decoding or sliding-window attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import npu_attention
from npu_vllm_bridge.settings import PREFIX, current_provider

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def check_context_parallel(vllm_config: VllmConfig) -> None:
    """Refuse the context-parallel setups the bridge cannot run (``ValueError``)."""
    parallel = vllm_config.parallel_config
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if pcp > 1:
        raise ValueError(
            f"{PREFIX} does not support prefill context parallelism (prefill_context_"
            f"parallel_size={pcp}; expected 1): a rank's prefill rows are two chunks of "
            "the sequence (vLLM's DualChunkSwap), and the bridge's attention plans take "
            "query rows as the last positions of their sequence; use "
            "prefill_context_parallel_size=1 (decode context parallelism runs)"
        )
    dcp = getattr(parallel, "decode_context_parallel_size", 1)
    if dcp == 1:
        return
    model_config = vllm_config.model_config
    what = f"decode context parallelism (decode_context_parallel_size={dcp})"
    if model_config is not None and model_config.use_mla:
        check_mla_lse(what, model_config.model)
    if vllm_config.speculative_config is not None:
        method = vllm_config.speculative_config.method
        raise ValueError(
            f"{PREFIX} does not run {what} with speculative decoding (method={method!r}); "
            "use decode_context_parallel_size=1 or no speculative_config"
        )
    window = model_config.get_sliding_window() if model_config is not None else None
    if window is not None:
        raise ValueError(
            f"{PREFIX} runs {what} for full attention only, got sliding_window={window} "
            f"({model_config.model}); use decode_context_parallel_size=1"
        )


def check_mla_lse(what: str, model: str) -> None:
    """Refuse DCP for an MLA model when the platform's MLA provider returns no LSE."""
    provider = current_provider("mla")
    if not npu_attention.returns_lse(provider, family="mla"):
        raise ValueError(
            f"{PREFIX} runs {what} for MLA models ({model}) only with an MLA provider "
            f"that returns the log-sum-exp; the {provider!r} provider does not (its MLA "
            "decode writes no LSE); use decode_context_parallel_size=1"
        )
