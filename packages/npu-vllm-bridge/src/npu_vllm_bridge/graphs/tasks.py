"""Attention as an updatable graph task: eager call, or recorded under capture."""

from __future__ import annotations

import torch

import npu_attention
from npu_attention import AttentionPlan


def run_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    out: torch.Tensor,
) -> None:
    """``npu_attention.run`` for one layer."""
    npu_attention.run(query, key, value, key_cache, value_cache, plan, out)
