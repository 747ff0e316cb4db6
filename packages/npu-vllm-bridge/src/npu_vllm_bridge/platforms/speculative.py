"""Start-up checks for speculative decoding.

The bridge runs the verify step of every drafter as a decode batch of
``1 + num_speculative_tokens`` query tokens per request (``npu_attention``'s
spec-decode state), and a drafter with attention layers (EAGLE-style heads,
draft models, MTP) through the same attention backend, in its own KV-cache
pages. What it accepts:

* ``ngram`` (no draft model);
* ``eagle`` / ``eagle3`` draft heads and ``draft_model`` drafts whose attention
  the bridge can serve and whose KV-cache layout is the target's (paged K/V of
  the same dtype; MLA latent caches only with an MLA target);
* ``mtp`` (and vLLM's per-model MTP names) on an MLA (DeepSeek-shaped) target,
  when the bridge has an MLA backend.

Everything else is refused here, with what to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import npu_attention
from npu_vllm_bridge.attention.capabilities import refuse_head_size
from npu_vllm_bridge.settings import PREFIX, current_provider
from npu_vllm_bridge.spec_methods import (
    DRAFT_FREE_METHODS,
    DRAFT_HEAD_METHODS,
    MAX_QUERY_TOKENS_PER_REQUEST,
    accepted_methods,
    mtp_methods,
)

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig


def check_speculative(vllm_config: VllmConfig) -> None:
    """Refuse the speculative-decoding setups the bridge cannot run (``ValueError``)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return
    method = spec.method
    if method not in accepted_methods():
        raise ValueError(
            f"{PREFIX} does not support speculative decoding method {method!r}; use one of "
            f"{list(DRAFT_FREE_METHODS + DRAFT_HEAD_METHODS)} or MTP ('mtp')"
        )
    k = spec.num_speculative_tokens or 0
    if 1 + k > MAX_QUERY_TOKENS_PER_REQUEST:
        raise ValueError(
            f"{PREFIX} verifies at most {MAX_QUERY_TOKENS_PER_REQUEST - 1} speculative tokens "
            f"per request (the NPU's fused attention takes {MAX_QUERY_TOKENS_PER_REQUEST} query "
            f"tokens per request), got num_speculative_tokens={k}"
        )
    if getattr(spec, "uses_dynamic_speculative_decoding", lambda: False)():
        raise ValueError(
            f"{PREFIX} captures verify graphs for one num_speculative_tokens; "
            "num_speculative_tokens_per_batch_size is not supported"
        )
    if getattr(spec, "parallel_drafting", False):
        raise ValueError(f"{PREFIX} does not support parallel drafting (parallel_drafting=True)")
    target = vllm_config.model_config
    if method in mtp_methods():
        _check_mtp(target, method)
    if method in DRAFT_FREE_METHODS or spec.draft_model_config is None:
        return
    _check_draft_layout(target, spec.draft_model_config, method)


def check_quantized_verify(vllm_config: VllmConfig) -> None:
    """Refuse speculative decoding over an 8-bit KV cache in FULL graphs where the
    provider cannot capture a verify step over quantized pages (``ValueError`` naming
    the provider, the kind and what to change): its replays would re-run a stale
    dequantization outside the graph."""
    spec = vllm_config.speculative_config
    kv_cache_dtype = vllm_config.cache_config.cache_dtype
    if spec is None or kv_cache_dtype in (None, "auto"):
        return
    if not vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs():
        return
    model_config = vllm_config.model_config
    family = "mla" if model_config is not None and model_config.use_mla else "attention"
    provider = current_provider(family)
    if npu_attention.quantized_verify_in_graphs(provider, family):
        return
    raise ValueError(
        f"{PREFIX}: the {provider!r} attention provider cannot run speculative decoding's "
        f"verify steps over kv_cache_dtype={kv_cache_dtype!r} pages in FULL graphs; use "
        "kv_cache_dtype='auto', or cudagraph_mode PIECEWISE (or --enforce-eager) with "
        f"{kv_cache_dtype!r}"
    )


def _check_mtp(target: ModelConfig | None, method: str) -> None:
    if target is None or not target.use_mla:
        name = None if target is None else target.model
        raise ValueError(
            f"{PREFIX} runs MTP speculative decoding (method {method!r}) only on MLA "
            f"(DeepSeek-shaped) models; {name} is not one: use 'eagle', 'draft_model' or 'ngram'"
        )


def _check_draft_layout(target: ModelConfig | None, draft: ModelConfig, method: str) -> None:
    """The draft's attention must be one the bridge serves, in the target's KV-cache
    layout: both paged K/V (or both MLA latent), in the same dtype."""
    name = draft.model
    if target is not None and bool(draft.use_mla) != bool(target.use_mla):
        kinds = {True: "an MLA latent cache", False: "paged K/V"}
        raise ValueError(
            f"{PREFIX}: the {method} draft {name} keeps {kinds[bool(draft.use_mla)]} but the "
            f"target {target.model} keeps {kinds[bool(target.use_mla)]}; the draft's KV-cache "
            "layout must be the target's"
        )
    if target is not None and draft.dtype != target.dtype:
        raise ValueError(
            f"{PREFIX}: the {method} draft {name} runs in {draft.dtype} but the target in "
            f"{target.dtype}; the draft's KV cache must have the target's dtype"
        )
    if draft.use_mla:
        return
    refuse_head_size(draft.get_head_size(), f"the {method} draft {name}")
