"""The layer-invariant description of DeepSeek-style multi-head latent attention."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from npu_attention import kv_quant
from npu_attention.spec import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, SUPPORTED_DTYPES, StepSpec

MAX_DIM = 1024  # sanity bound on each width; providers declare what they take
# The latent cache's kinds: vLLM's MLA layers take a per-tensor fp8 cache.
MLA_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class MLASpec(StepSpec):
    """Multi-head latent attention (MLA) of one layer, as in DeepSeek-V2/V3.

    Every token stores one latent row of ``latent_dim = kv_lora_rank +
    qk_rope_head_dim`` values in a paged cache: the compressed KV ``kv_c`` (width
    ``kv_lora_rank``) and the rotary key ``k_pe`` (width ``qk_rope_head_dim``),
    shared by all heads. Head ``n`` sees ``k_nope = kv_c @ W_UK[n]`` (width
    ``qk_nope_head_dim``) and ``v = kv_c @ W_UV[n]`` (width ``v_head_dim``).

    Attributes:
        num_heads: query heads ``N``.
        kv_lora_rank: width ``L`` of the compressed KV.
        qk_nope_head_dim: width ``P`` of the non-rotary query/key part per head.
        qk_rope_head_dim: width ``R`` of the rotary part (query per head, key shared).
        v_head_dim: width ``V`` of a head's value and output.
        block_size: tokens per cache page, 16 to 128 (multiples of 16).
        dtype: dtype of queries, caches and outputs.
        scale: score scale; ``None`` means ``1 / sqrt(P + R)``.
        num_speculative_tokens: draft tokens verified per decode request (0 = none).
        kv_cache_dtype: ``"auto"`` (latent rows in ``dtype``) or ``"fp8"`` /
            ``"fp8_e4m3"``: float8_e4m3fn rows with one float32 scale for the whole cache
            (vLLM's MLA layers: their ``_k_scale``), ``code = e4m3(clamp(x / s, ±448))``.
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    block_size: int
    dtype: torch.dtype = torch.bfloat16
    scale: float | None = None
    num_speculative_tokens: int = 0
    kv_cache_dtype: str = "auto"

    provider_family: ClassVar[str] = "mla"

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
            _check_width(name, getattr(self, name))
        _check_width("v_head_dim", self.v_head_dim)
        for name in ("latent_dim", "qk_head_dim"):
            if getattr(self, name) > MAX_DIM:
                raise ValueError(f"{name} must be <= {MAX_DIM}, got {getattr(self, name)}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype}")
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE or self.block_size % 16:
            raise ValueError(
                f"block_size must be a multiple of 16 in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                f"got {self.block_size}"
            )
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"scale must be positive or None, got {self.scale}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be an int >= 0, got {self.num_speculative_tokens!r}"
            )
        if self.kv_cache_dtype not in MLA_KV_CACHE_DTYPES:
            raise ValueError(
                f"MLA kv_cache_dtype must be one of {list(MLA_KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}"
            )

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype of the latent rows: ``dtype``, or ``torch.float8_e4m3fn`` for fp8."""
        return kv_quant.cache_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Width of a decompressed query/key head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.qk_head_dim)


def _check_width(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DIM:
        raise ValueError(f"{name} must be an int in [1, {MAX_DIM}], got {value!r}")
