"""Per-layer execution: write the step's K/V into the cache, then attend."""

from __future__ import annotations

import torch

from npu_attention.kv_quant import KVScales, ScaleKind
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
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
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
        k_scale, v_scale: the scales of a quantized cache (``spec.kv_cache_dtype``, see
            ``npu_attention.kv_quant``), float32 on the plan's device: one element each
            for ``fp8``/``fp8_e4m3``; ``[num_blocks, block_size, num_kv_heads]`` (any
            strides, written with the step's rows) for the per-token-head kinds;
            ``None`` for ``auto``. The caches then hold ``spec.cache_dtype``.

    With a quantized cache every key read from the pages is dequantized (``code *
    scale``); a prefill without cached context (``PREFILL_NO_CACHE``) given ``key``
    and ``value`` attends over those rows as they are.

    The new K/V of token ``t < plan.num_actual_tokens`` is written at
    ``plan.slot_mapping[t]`` unless that slot is negative (padding). Rows of
    ``out`` at and beyond ``plan.num_actual_tokens`` (graph padding) are left
    untouched. Only shapes are checked here; nothing waits for the device.

    Raises:
        ValueError: shapes, head counts or devices that disagree with the plan; scales
            of the wrong shape or device, missing where the kind takes them or given
            where it takes none.
        TypeError: a dtype other than ``plan.spec.dtype`` (``spec.cache_dtype`` for the
            caches, float32 for scales).
    """
    _check_run_inputs(query, key, value, key_cache, value_cache, plan, out)
    if plan.provider.contiguous_inputs:
        check_contiguous_inputs(plan, query=query, key=key, value=value, out=out, lse=lse)
    scales = check_scales(k_scale, v_scale, key_cache, plan)
    if lse is not None:
        check_lse(lse, plan)
    extra = {} if scales is None else {"scales": scales}
    provider = plan.provider
    if key is not None and key_cache is not None:
        provider.write_kv(key, value, key_cache, value_cache, plan, **extra)
    if lse is not None:
        extra["lse"] = lse
    provider.attend(query, key_cache, value_cache, plan, out, key, value, **extra)
    return out


def check_scales(
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    key_cache: torch.Tensor | None,
    plan: AttentionPlan,
) -> KVScales | None:
    """The checked ``KVScales`` of a quantized spec's cache, ``None`` for ``auto`` (or a
    call without caches).

    Raises:
        ValueError / TypeError: naming what the spec's ``kv_cache_dtype`` expects and what
            came.
    """
    spec = plan.spec
    kind = spec.kv_scales
    given = {"k_scale": k_scale, "v_scale": v_scale}
    if kind is ScaleKind.NONE or key_cache is None:
        for name, scale in given.items():
            if scale is not None:
                what = f"kv_cache_dtype={spec.kv_cache_dtype!r}"
                if key_cache is None:
                    what = "attention without a cache"
                raise ValueError(f"{what} takes no scales, got {name} {_describe(scale)}")
        return None
    if kind is ScaleKind.PER_TENSOR:
        shape, expected = None, "one element"
    else:
        shape = (key_cache.shape[0], spec.block_size, spec.num_kv_heads)
        expected = f"shape [num_blocks, block_size, num_kv_heads] = {list(shape)}"
    for name, scale in given.items():
        if scale is None:
            raise ValueError(
                f"kv_cache_dtype={spec.kv_cache_dtype!r} needs {name}: float32 with "
                f"{expected}, got None"
            )
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} must have dtype torch.float32, got {scale.dtype}")
        fits = scale.numel() == 1 and scale.dim() <= 1 if shape is None else scale.shape == shape
        if not fits:
            raise ValueError(
                f"{name} of kv_cache_dtype={spec.kv_cache_dtype!r} must have {expected}, "
                f"got shape {list(scale.shape)}"
            )
        if scale.device != plan.device:
            raise ValueError(f"{name} must be on {plan.device}, got {scale.device}")
    return KVScales(k_scale, v_scale)


def _describe(scale: object) -> str:
    if isinstance(scale, torch.Tensor):
        return f"of shape {list(scale.shape)}"
    return f"of type {type(scale).__name__}"


def check_contiguous_inputs(plan: AttentionPlan, **tensors: torch.Tensor | None) -> None:
    """The step's rows (the first ``plan.num_actual_tokens``) of each tensor given are
    contiguous, as a provider with ``contiguous_inputs`` reads them; checked before
    anything is written.

    Raises:
        ValueError: naming the tensor, its shape and strides.
    """
    n = plan.num_actual_tokens
    for name, tensor in tensors.items():
        if tensor is not None and not tensor[:n].is_contiguous():
            raise ValueError(
                f"attention provider {plan.provider.name!r} needs contiguous {name} rows "
                f"(it does not copy inside a graph task; copy before run), got strides "
                f"{tensor.stride()} for shape {tuple(tensor.shape)}"
            )


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
        _check_tensor("key_cache", key_cache, plan, cache_shape, spec.cache_dtype)
        _check_tensor("value_cache", value_cache, plan, cache_shape, spec.cache_dtype)
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
    name: str,
    tensor: torch.Tensor,
    plan: AttentionPlan,
    trailing: tuple[int, ...],
    dtype: torch.dtype | None = None,
) -> None:
    """``tensor`` is ``[rows, *trailing]`` with ``dtype`` (default: the plan's), the
    plan's device and enough rows."""
    dtype = plan.spec.dtype if dtype is None else dtype
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape[1:]) != trailing or tensor.dim() != len(trailing) + 1:
        raise ValueError(
            f"{name} must have shape [*, {', '.join(map(str, trailing))}], "
            f"got {tuple(tensor.shape)}"
        )
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {tensor.dtype}")
    if tensor.device != plan.device:
        raise ValueError(f"{name} must be on {plan.device}, got {tensor.device}")
    if len(trailing) == 2 and tensor.shape[0] < plan.num_actual_tokens:
        raise ValueError(
            f"{name} must have >= num_actual_tokens={plan.num_actual_tokens} rows, "
            f"got {tensor.shape[0]}"
        )
