"""Per-layer execution: write the step's K/V into the cache, then attend."""

from __future__ import annotations

import torch

from npu_attention.plan import AttentionPlan
from npu_attention.spec import AttentionSpec


def run(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    key_cache: torch.Tensor | None,
    value_cache: torch.Tensor | None,
    plan: AttentionPlan,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for one layer of the step described by ``plan``; returns ``out``.

    Args:
        query: ``[num_tokens, num_heads, head_size]`` (TND), ``spec.dtype``;
            ``num_tokens >= plan.num_actual_tokens``.
        key, value: ``[num_tokens, num_kv_heads, head_size]``, the step's new keys
            and values, or both ``None`` when they are already in the cache.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``,
            any strides (e.g. K and V views split from one packed tensor), or both
            ``None`` for attention without a cache (encoder): then each request
            attends over its own ``key``/``value`` rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``.
        plan: from ``npu_attention.plan`` for this step.
        out: ``[num_tokens, num_heads, head_size]``, ``spec.dtype``, written in place.
        lse: optional float32 ``[num_tokens, num_heads]``: when given, row ``t`` gets the
            natural-log log-sum-exp of query ``t``'s scaled (and soft-capped) scores over
            the keys it sees, ``log(sum_j exp(s_tj))``, what ``merge_attention_states``
            takes. A row that sees no key gets ``-inf`` and an ``out`` row of zeros.

    The new K/V of token ``t < plan.num_actual_tokens`` is written at
    ``plan.slot_mapping[t]`` unless that slot is negative (padding). Rows of
    ``out`` at and beyond ``plan.num_actual_tokens`` (graph padding) are left
    untouched. Only shapes are checked here; nothing waits for the device.

    Raises:
        ValueError: shapes, head counts or devices that disagree with the plan.
        TypeError: a dtype other than ``plan.spec.dtype``.
    """
    _check_run_inputs(query, key, value, key_cache, value_cache, plan, out)
    provider = plan.provider
    if key is not None and key_cache is not None:
        provider.write_kv(key, value, key_cache, value_cache, plan)
    if lse is None:
        provider.attend(query, key_cache, value_cache, plan, out, key, value)
    else:
        check_lse(lse, plan)
        provider.attend(query, key_cache, value_cache, plan, out, key, value, lse=lse)
    return out


def check_lse(lse: torch.Tensor, plan: AttentionPlan, rows: str = "num_actual_tokens") -> None:
    """``lse`` is float32 ``[>= plan.<rows>, num_heads]`` on the plan's device and the
    provider can write it.

    Raises:
        TypeError / ValueError: naming what was expected and what came.
    """
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor or None, got {type(lse).__name__}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must have dtype torch.float32, got {lse.dtype}")
    heads = plan.spec.num_heads
    count = getattr(plan, rows)
    if lse.dim() != 2 or lse.shape[1] != heads or lse.shape[0] < count:
        raise ValueError(
            f"lse must have shape [>= {rows}={count}, {heads}], got {tuple(lse.shape)}"
        )
    if lse.device != plan.device:
        raise ValueError(f"lse must be on {plan.device}, got {lse.device}")
    if not plan.provider.returns_lse:
        raise ValueError(
            f"attention provider {plan.provider.name!r} does not return the log-sum-exp "
            "(lse=); plan with a provider whose returns_lse is True, e.g. 'reference'"
        )


def _check_run_inputs(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    key_cache: torch.Tensor | None,
    value_cache: torch.Tensor | None,
    plan: AttentionPlan,
    out: torch.Tensor,
) -> None:
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
    spec = plan.spec
    if not isinstance(spec, AttentionSpec):
        raise TypeError(
            f"run takes plans made for an AttentionSpec, got one for {type(spec).__name__} "
            "(MLA runs through npu_attention.mla)"
        )
    _check_tensor("query", query, plan, (spec.num_heads, spec.head_size))
    _check_tensor("out", out, plan, (spec.num_heads, spec.head_size))
    if (key is None) != (value is None):
        raise ValueError("key and value must both be given or both be None")
    if (key_cache is None) != (value_cache is None):
        raise ValueError("key_cache and value_cache must both be given or both be None")
    if key is not None:
        _check_tensor("key", key, plan, (spec.num_kv_heads, spec.head_size))
        _check_tensor("value", value, plan, (spec.num_kv_heads, spec.head_size))
    if key_cache is not None:
        cache_shape = (spec.block_size, spec.num_kv_heads, spec.head_size)
        _check_tensor("key_cache", key_cache, plan, cache_shape)
        _check_tensor("value_cache", value_cache, plan, cache_shape)
        if not plan.has_cache and plan.max_seq_len > 0:
            raise ValueError(
                "the plan was made without block tables (block_tables=None), "
                "so run takes no caches; got key_cache and value_cache"
            )
        if key_cache.shape[0] != value_cache.shape[0]:
            raise ValueError(
                f"key_cache and value_cache must have as many blocks, got "
                f"{key_cache.shape[0]} and {value_cache.shape[0]}"
            )
    elif key is None:
        raise ValueError("run needs key/value, key_cache/value_cache, or both; got neither")
    elif plan.has_context:
        raise ValueError(
            "attention without a cache needs every request's keys in this step "
            f"(context_lens all 0), got max context length {plan.max_context_len}"
        )


def _check_tensor(
    name: str, tensor: torch.Tensor, plan: AttentionPlan, trailing: tuple[int, ...]
) -> None:
    """``tensor`` is ``[rows, *trailing]`` with the plan's dtype, device and enough rows."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape[1:]) != trailing or tensor.dim() != len(trailing) + 1:
        raise ValueError(
            f"{name} must have shape [*, {', '.join(map(str, trailing))}], "
            f"got {tuple(tensor.shape)}"
        )
    if tensor.dtype != plan.spec.dtype:
        raise TypeError(f"{name} must have dtype {plan.spec.dtype}, got {tensor.dtype}")
    if tensor.device != plan.device:
        raise ValueError(f"{name} must be on {plan.device}, got {tensor.device}")
    if len(trailing) == 2 and tensor.shape[0] < plan.num_actual_tokens:
        raise ValueError(
            f"{name} must have >= num_actual_tokens={plan.num_actual_tokens} rows, "
            f"got {tensor.shape[0]}"
        )
