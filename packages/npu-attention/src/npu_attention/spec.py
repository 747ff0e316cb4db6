"""Layer-invariant attention description and the batch states a step can be in."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from npu_attention import kv_quant

MAX_HEAD_SIZE = 1024  # sanity bound; each provider declares the sizes it takes
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 128


class BatchState(enum.Enum):
    """What kind of batch a step holds; providers pick kernels by it.

    - ``PREFILL_NO_CACHE``: only prefills, none reads cached context.
    - ``PREFILL_CACHE_HIT``: only prefills, at least one reads cached context
      (prefix-cache hit or a later chunk of a chunked prefill).
    - ``DECODE_ONLY``: every request has exactly one query token.
    - ``SPEC_DECODING``: every request is a decode with ``1 + num_speculative_tokens``
      query tokens (speculative tokens are verified against the cache).
    - ``CHUNKED_PREFILL``: decodes and prefills mixed, decodes first.
    """

    PREFILL_NO_CACHE = "prefill_no_cache"
    PREFILL_CACHE_HIT = "prefill_cache_hit"
    DECODE_ONLY = "decode_only"
    SPEC_DECODING = "spec_decoding"
    CHUNKED_PREFILL = "chunked_prefill"


class StepSpec:
    """What ``plan`` needs of a layer description, whatever the attention kind.

    Subclasses have ``block_size``, ``dtype`` and ``num_speculative_tokens``
    fields; ``provider_family`` names the provider registry ``plan`` chooses from
    (``"attention"``: ``AttentionSpec``; ``"mla"``: ``npu_attention.mla.MLASpec``).
    """

    provider_family: ClassVar[str]
    block_size: int
    dtype: torch.dtype
    num_speculative_tokens: int


@dataclass(frozen=True)
class AttentionSpec(StepSpec):
    """Everything about attention that is fixed for a layer (or a group of layers).

    Attributes:
        num_heads: query heads.
        num_kv_heads: key/value heads; ``num_heads % num_kv_heads == 0`` (MHA, GQA, MQA).
        head_size: a positive int up to ``MAX_HEAD_SIZE``; which sizes run depends on
            the provider (``npu_attention.supported_head_sizes``), checked by ``plan``.
        block_size: tokens per KV-cache page, 16 to 128.
        dtype: dtype of query, key, value, caches and output.
        causal: causal (decoder) or full (encoder) attention.
        sliding_window: ``W`` keeps the ``W`` most recent keys, the query's own
            position included (key ``j`` is visible to query ``i`` iff ``i - W < j <= i``;
            without ``causal``, iff ``|i - j| < W``); ``None`` for no window.
        logits_soft_cap: ``c`` replaces each score ``s`` by ``c * tanh(s / c)``; ``None`` off.
        scale: score scale; ``None`` means ``1 / sqrt(head_size)``.
        num_speculative_tokens: draft tokens verified per decode request (0 = none).
        kv_cache_dtype: what the pages hold (``npu_attention.kv_quant``): ``"auto"``
            (``dtype``), ``"fp8"`` / ``"fp8_e4m3"`` (float8_e4m3fn pages, a scale per
            tensor), ``"int8_per_token_head"`` / ``"fp8_per_token_head"`` (int8 or
            float8_e4m3fn pages, a scale per token and KV head written with each row).
            Query, key, value and output stay in ``dtype``.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype = torch.float16
    causal: bool = True
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    scale: float | None = None
    num_speculative_tokens: int = 0
    kv_cache_dtype: str = "auto"

    provider_family: ClassVar[str] = "attention"

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0:
            raise ValueError(
                f"head counts must be positive, got num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads must be a multiple of num_kv_heads, got "
                f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}"
            )
        if (
            not isinstance(self.head_size, int)
            or isinstance(self.head_size, bool)
            or not 1 <= self.head_size <= MAX_HEAD_SIZE
        ):
            raise ValueError(
                f"head_size must be an int in [1, {MAX_HEAD_SIZE}], got {self.head_size!r}"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype}")
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE or self.block_size % 16:
            raise ValueError(
                f"block_size must be a multiple of 16 in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                f"got {self.block_size}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
            raise ValueError(
                f"logits_soft_cap must be positive or None, got {self.logits_soft_cap}"
            )
        if self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}"
            )
        kv_quant.check_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype of the KV pages: ``dtype``, ``torch.int8`` or ``torch.float8_e4m3fn``."""
        return kv_quant.cache_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def kv_scales(self) -> kv_quant.ScaleKind:
        """Where the cache's scales live (``ScaleKind.NONE`` for ``auto``)."""
        return kv_quant.scale_kind(self.kv_cache_dtype)

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_size)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
