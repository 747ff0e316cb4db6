"""Start-up checks for context parallelism (DCP and PCP).

Decode context parallelism (``decode_context_parallel_size`` > 1) runs for GQA/MQA
models with full attention (``attention/context_parallel.py``; vLLM itself checks
the head counts: a tensor-parallel size above the KV heads) and for MLA models
(``attention/mla_context_parallel.py``) whose provider returns the log-sum-exp.
Prefill context parallelism (``prefill_context_parallel_size`` > 1) runs where vLLM
0.32 runs it, in its V2 model runner for MLA models (``mla_builder.py``: each chunk of
a rank's prefill is a request of the rank's batch, and the rows vLLM's layer gathers
from every rank are written by the step's ``write_plan``). Refused here:

* prefill context parallelism with speculative decoding or with DCP (vLLM 0.32 runs
  PCP + DCP only for sparse MLA, which the bridge does not run);
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
    if pcp > 1 and vllm_config.speculative_config is not None:
        raise ValueError(
            f"{PREFIX} does not run prefill context parallelism (prefill_context_parallel_"
            f"size={pcp}) with speculative decoding (method="
            f"{vllm_config.speculative_config.method!r}); use prefill_context_parallel_size=1 "
            "or no speculative_config"
        )
    dcp = getattr(parallel, "decode_context_parallel_size", 1)
    if pcp > 1 and dcp > 1:
        raise ValueError(
            f"{PREFIX} does not run prefill context parallelism (prefill_context_parallel_"
            f"size={pcp}) together with decode context parallelism (decode_context_"
            f"parallel_size={dcp}); set one of them to 1"
        )
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
