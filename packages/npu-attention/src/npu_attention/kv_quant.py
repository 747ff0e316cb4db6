"""Quantized KV caches: the kinds, where their scales live, and their definitions.

The kinds and their arithmetic are vLLM's (``--kv-cache-dtype``, vLLM 0.32):

* ``fp8`` / ``fp8_e4m3``: pages of ``torch.float8_e4m3fn`` with one float32 scale per
  tensor for the keys and one for the values (a layer's ``_k_scale``/``_v_scale``):
  ``code = e4m3(clamp(x / scale, -448, 448))``, ``x ~ code * scale``.
* ``int8_per_token_head``: pages of ``torch.int8`` with a float32 scale per token and
  KV head, computed as the row is written: ``scale = max(absmax(x) / 127, 1e-6)``,
  ``code = clamp(round_half_away(x * (1 / scale)), -128, 127)``.
* ``fp8_per_token_head``: the same with ``torch.float8_e4m3fn`` pages and 448 in place
  of 127 (``code = e4m3(clamp(x * (1 / scale), -448, 448))``, rounded to nearest even).

Per-token-head scales live beside the pages, float32 ``[num_blocks, block_size,
num_kv_heads]`` of any strides (vLLM keeps each one in the four bytes after its head's
row; ``npu_attention`` takes views of them). ``auto`` keeps the pages in the model
dtype and takes no scales.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
MIN_TOKEN_HEAD_SCALE = 1e-6


class ScaleKind(enum.Enum):
    """Where a kind's scales live: nowhere, one per tensor, one per token and KV head."""

    NONE = "none"
    PER_TENSOR = "per_tensor"
    PER_TOKEN_HEAD = "per_token_head"


class KVScales(NamedTuple):
    """The scales of one layer's cache: float32 tensors on the cache's device.

    Per tensor: ``k`` and ``v`` hold one element each (shape ``[]`` or ``[1]``).
    Per token and head: ``[num_blocks, block_size, num_kv_heads]``, any strides, written
    together with the pages.
    """

    k: torch.Tensor
    v: torch.Tensor


def scale_kind(kv_cache_dtype: str) -> ScaleKind:
    """The ``ScaleKind`` of ``kv_cache_dtype`` (one of ``KV_CACHE_DTYPES``)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return ScaleKind.NONE
    if kv_cache_dtype.endswith("per_token_head"):
        return ScaleKind.PER_TOKEN_HEAD
    return ScaleKind.PER_TENSOR


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the pages of ``kv_cache_dtype`` for a model of ``model_dtype``."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype.startswith("int8"):
        return torch.int8
    return torch.float8_e4m3fn


def check_kv_cache_dtype(kv_cache_dtype: object) -> None:
    """Raise ``ValueError`` unless ``kv_cache_dtype`` is one of ``KV_CACHE_DTYPES``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )


def code_max(dtype: torch.dtype) -> float:
    """The largest magnitude a page of ``dtype`` (int8 or float8_e4m3fn) stores."""
    return INT8_MAX if dtype == torch.int8 else FP8_MAX


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of ``x`` (any shape) with one ``scale``: saturated, rounded
    to nearest even."""
    scaled = x.to(torch.float32) / scale.to(torch.float32).reshape(())
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_per_token_head(
    x: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``x`` ``[tokens, heads, head_size]`` in ``dtype`` (int8 or
    float8_e4m3fn) and float32 scales ``[tokens, heads]``, one per row."""
    x = x.to(torch.float32)
    top = code_max(dtype)
    scales = (x.abs().amax(dim=-1) / top).clamp_min_(MIN_TOKEN_HEAD_SCALE)
    scaled = x * (1.0 / scales).unsqueeze(-1)
    if dtype == torch.int8:  # round half away from zero, then the cast truncates
        scaled = torch.where(scaled >= 0, scaled + 0.5, scaled - 0.5).clamp_(-128.0, 127.0)
    else:
        scaled = scaled.clamp_(-top, top)
    return scaled.to(dtype), scales


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``codes * scale`` (``scale`` broadcast: one element, or one per row
    with a trailing dim of 1)."""
    return codes.to(torch.float32) * scale.to(torch.float32)
