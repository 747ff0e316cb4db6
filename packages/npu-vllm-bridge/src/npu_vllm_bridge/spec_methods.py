"""The speculative-decoding methods the bridge runs."""

from __future__ import annotations

from typing import get_args

# The NPU's fused attention in TND layout caps a request at 16 query tokens, so a
# verify step may carry at most 15 draft tokens per request.
MAX_QUERY_TOKENS_PER_REQUEST = 16
DRAFT_FREE_METHODS = ("ngram",)
DRAFT_HEAD_METHODS = ("eagle", "eagle3", "draft_model")


def mtp_methods() -> tuple[str, ...]:
    """vLLM's names of MTP drafters (``"mtp"`` and the per-model ``"*_mtp"``)."""
    from vllm.config.speculative import MTPModelTypes

    return tuple(get_args(MTPModelTypes))


def accepted_methods() -> tuple[str, ...]:
    """Every speculative-decoding method the bridge accepts."""
    return (*DRAFT_FREE_METHODS, *DRAFT_HEAD_METHODS, *mtp_methods())
