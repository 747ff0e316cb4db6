"""Per-layer MLA execution: latent cache write, absorbed decode, non-absorbed prefill.

The split follows vLLM's MLA layer: the cache write runs first (every key a step
attends to, its own new tokens included, is read from the cache), decode requests
(the plan's first ``num_decodes``) attend in latent space and their output is
up-projected by the caller with ``W_UV``; prefill requests attend over keys and
values decompressed from the cache by the caller's ``kv_up_proj``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from npu_attention.mla.cache import LatentCache, check_latent_cache
from npu_attention.mla.spec import MLASpec
from npu_attention.plan import AttentionPlan
from npu_attention.run import check_lse

# kv_c rows [n, kv_lora_rank] -> per-head [k_nope | v], [n, num_heads * (P + V)] or
# [n, num_heads, P + V] (vLLM's kv_b_proj output).
KVUpProjection = Callable[[torch.Tensor], torch.Tensor]


def mla_write_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: LatentCache,
    plan: AttentionPlan,
    *,
    k_scale: torch.Tensor | None = None,
) -> None:
    """Write the step's latents into ``cache`` at ``plan.slot_mapping``.

    Args:
        kv_c: ``[num_tokens, kv_lora_rank]``, ``spec.dtype`` (normalized compressed KV).
        k_pe: ``[num_tokens, qk_rope_head_dim]``, ``spec.dtype`` (rotary key, rotated).
        cache: the layer's ``LatentCache``.
        plan: from ``npu_attention.plan`` with an ``MLASpec``.
        k_scale: an fp8 cache's scale (``spec.kv_cache_dtype`` ``fp8`` / ``fp8_e4m3``):
            float32, one element, on the plan's device; ``None`` for ``auto``. The same
            scale quantizes and dequantizes both planes (vLLM's MLA ``_k_scale``).

    Token ``t < plan.num_actual_tokens`` is written unless its slot is ``-1``;
    rows past ``num_actual_tokens`` (graph padding) are never read.

    Raises:
        TypeError: a plan not made for an ``MLASpec``, or wrong dtypes.
        ValueError: shapes or devices that disagree with the plan.
    """
    spec = _mla_spec(plan)
    _check_rows("kv_c", kv_c, plan, (spec.kv_lora_rank,), plan.num_actual_tokens)
    _check_rows("k_pe", k_pe, plan, (spec.qk_rope_head_dim,), plan.num_actual_tokens)
    check_latent_cache(cache, spec, plan.device)
    extra = _scale_kwargs(k_scale, plan)
    plan.provider.write_cache(kv_c, k_pe, cache, plan, **extra)


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentCache,
    plan: AttentionPlan,
    out: torch.Tensor,
    *,
    lse: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    finish: bool = True,
) -> torch.Tensor:
    """Absorbed (MQA) attention of the plan's decode requests; returns ``out``.

    Row ``t < plan.num_decode_tokens`` of request ``i`` scores key ``j`` as
    ``scale * (q_latent[t] . kv_c[j] + q_rope[t] . k_pe[j])`` for every cached
    position ``j <= context_lens[i] + (t - cu_seqlens_q[i])`` (speculative tokens are
    causal among themselves) and writes ``softmax . kv_c`` to ``out[t]``.

    Args:
        q_latent: ``[rows, num_heads, kv_lora_rank]``, ``q_nope`` absorbed by ``W_UK``.
        q_rope: ``[rows, num_heads, qk_rope_head_dim]``; ``rows >= plan.num_decode_tokens``.
        cache: the layer's ``LatentCache``, already holding this step's tokens.
        plan: from ``npu_attention.plan`` with an ``MLASpec``.
        out: ``[rows, num_heads, kv_lora_rank]``, written for the decode rows only
            (the caller up-projects it with ``W_UV``).
        lse: optional float32 ``[rows, num_heads]``: each decode row's natural-log
            log-sum-exp of its scaled scores, ``-inf`` for a request of KV length 0
            (whose ``out`` rows are zeros); what decode context parallelism merges
            by (``merge_attention_states``).
        k_scale: an fp8 cache's scale, as in ``mla_write_cache``: the latent rows are
            read as ``code * k_scale``.
        finish: False issues the provider's kernel alone (what a graph task holds: a
            task update re-issues nothing else); ``out`` and ``lse`` are then complete
            only after ``mla_finish_decode`` with the same tensors.

    Raises:
        TypeError: a plan not made for an ``MLASpec``, or wrong dtypes.
        ValueError: shapes or devices that disagree with the plan, or ``lse`` asked
            of a provider that cannot write it.
    """
    spec = _mla_spec(plan)
    rows = plan.num_decode_tokens
    _check_rows("q_latent", q_latent, plan, (spec.num_heads, spec.kv_lora_rank), rows)
    _check_rows("q_rope", q_rope, plan, (spec.num_heads, spec.qk_rope_head_dim), rows)
    _check_rows("out", out, plan, (spec.num_heads, spec.kv_lora_rank), rows)
    check_latent_cache(cache, spec, plan.device)
    extra = _scale_kwargs(k_scale, plan)
    if lse is not None:
        check_lse(lse, plan, "num_decode_tokens")
        extra["lse"] = lse
    if rows:
        plan.provider.decode(q_latent, q_rope, cache, plan, out, **extra)
        if finish:
            plan.provider.finish_decode(q_latent, plan, out, lse=lse)
    return out


def mla_finish_decode(
    q_latent: torch.Tensor,
    plan: AttentionPlan,
    out: torch.Tensor,
    *,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Complete ``mla_decode(..., finish=False)`` of the same tensors; returns ``out``.

    The provider's device work after its decode kernel (copies out of the kernel's
    buffers, the LSE's dtype, rows of requests of KV length 0), issued outside a graph
    task and inside the graph: it reads ``plan.seq_lens`` on the device, which a graph
    step must keep at fixed addresses.

    Raises:
        TypeError / ValueError: as ``mla_decode`` for ``q_latent``, ``out``, ``lse``;
            ValueError from a provider that ran no decode of these shapes.
    """
    spec = _mla_spec(plan)
    rows = plan.num_decode_tokens
    _check_rows("q_latent", q_latent, plan, (spec.num_heads, spec.kv_lora_rank), rows)
    _check_rows("out", out, plan, (spec.num_heads, spec.kv_lora_rank), rows)
    if lse is not None:
        check_lse(lse, plan, "num_decode_tokens")
    if rows:
        plan.provider.finish_decode(q_latent, plan, out, lse=lse)
    return out


def mla_prefill(
    query: torch.Tensor,
    cache: LatentCache,
    plan: AttentionPlan,
    kv_up_proj: KVUpProjection,
    out: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Non-absorbed (MHA) causal attention of the plan's prefill requests; returns ``out``.

    Row ``t`` is the prefill token ``plan.num_decode_tokens + t``. Keys and values
    of each prefill request (its cached context and its new tokens) are
    decompressed from the cache: ``[k_nope | v] = kv_up_proj(kv_c)`` per head,
    ``k = [k_nope | k_pe]``; query position ``p`` sees keys ``<= p``.

    Args:
        query: ``[rows, num_heads, qk_nope_head_dim + qk_rope_head_dim]``
            (``[q_nope | q_pe]``); ``rows >= plan.num_prefill_tokens``.
        cache: the layer's ``LatentCache``, already holding this step's tokens.
        plan: from ``npu_attention.plan`` with an ``MLASpec``.
        kv_up_proj: ``kv_c`` ``[n, kv_lora_rank]`` -> ``[n, num_heads * (P + V)]`` or
            ``[n, num_heads, P + V]``, each head ``[k_nope | v]`` (vLLM's ``kv_b_proj``).
        out: ``[rows, num_heads, v_head_dim]``, written for the prefill rows only.
        k_scale: an fp8 cache's scale, as in ``mla_write_cache``: the latent rows are
            dequantized to ``spec.dtype`` before ``kv_up_proj``.

    Raises:
        TypeError: a plan not made for an ``MLASpec``, wrong dtypes, or a
            ``kv_up_proj`` that is not callable.
        ValueError: shapes or devices that disagree with the plan.
    """
    spec = _mla_spec(plan)
    rows = plan.num_prefill_tokens
    _check_rows("query", query, plan, (spec.num_heads, spec.qk_head_dim), rows)
    _check_rows("out", out, plan, (spec.num_heads, spec.v_head_dim), rows)
    check_latent_cache(cache, spec, plan.device)
    if not callable(kv_up_proj):
        raise TypeError(f"kv_up_proj must be callable, got {type(kv_up_proj).__name__}")
    extra = _scale_kwargs(k_scale, plan)
    if rows:
        plan.provider.prefill(query, cache, plan, kv_up_proj, out, **extra)
    return out


def up_projected_heads(
    kv_up_proj: KVUpProjection, kv_c: torch.Tensor, spec: MLASpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_up_proj(kv_c)`` split per head: ``k_nope`` ``[n, N, P]`` and ``v`` ``[n, N, V]``.

    Raises:
        ValueError: an output that is not ``[n, N * (P + V)]`` or ``[n, N, P + V]``.
    """
    n, width = kv_c.shape[0], spec.qk_nope_head_dim + spec.v_head_dim
    projected = kv_up_proj(kv_c)
    if not isinstance(projected, torch.Tensor) or tuple(projected.shape) not in (
        (n, spec.num_heads * width),
        (n, spec.num_heads, width),
    ):
        shape = tuple(projected.shape) if isinstance(projected, torch.Tensor) else projected
        raise ValueError(
            f"kv_up_proj must map [{n}, {spec.kv_lora_rank}] to [{n}, "
            f"{spec.num_heads * width}] or [{n}, {spec.num_heads}, {width}], got {shape}"
        )
    heads = projected.reshape(n, spec.num_heads, width)
    k_nope, v = heads.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=-1)
    return k_nope, v


def _scale_kwargs(k_scale: torch.Tensor | None, plan: AttentionPlan) -> dict[str, torch.Tensor]:
    """``{"scale": k_scale}`` for an fp8 cache, ``{}`` for ``auto``, after checking it.

    Raises:
        ValueError / TypeError: a scale given to ``auto``, missing for fp8, or not a
            float32 tensor of one element on the plan's device.
    """
    kind = plan.spec.kv_cache_dtype
    if kind == "auto":
        if k_scale is not None:
            shape = list(k_scale.shape) if isinstance(k_scale, torch.Tensor) else k_scale
            raise ValueError(f"MLA kv_cache_dtype='auto' takes no k_scale, got {shape}")
        return {}
    if not isinstance(k_scale, torch.Tensor):
        raise ValueError(
            f"MLA kv_cache_dtype={kind!r} needs k_scale: a float32 tensor of one element, "
            f"got {type(k_scale).__name__}"
        )
    if k_scale.dtype != torch.float32:
        raise TypeError(f"k_scale must have dtype torch.float32, got {k_scale.dtype}")
    if k_scale.numel() != 1 or k_scale.dim() > 1:
        raise ValueError(
            f"k_scale of MLA kv_cache_dtype={kind!r} must have one element, got shape "
            f"{list(k_scale.shape)}"
        )
    if k_scale.device != plan.device:
        raise ValueError(f"k_scale must be on {plan.device}, got {k_scale.device}")
    return {"scale": k_scale}


def _mla_spec(plan: AttentionPlan) -> MLASpec:
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
    if not isinstance(plan.spec, MLASpec):
        raise TypeError(
            f"the MLA functions take plans made for an MLASpec, got one for "
            f"{type(plan.spec).__name__} (use npu_attention.run)"
        )
    return plan.spec


def _check_rows(
    name: str,
    tensor: torch.Tensor,
    plan: AttentionPlan,
    trailing: tuple[int, ...],
    min_rows: int,
) -> None:
    """``tensor`` is ``[rows >= min_rows, *trailing]`` of the plan's dtype and device."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(trailing) + 1 or tuple(tensor.shape[1:]) != trailing:
        raise ValueError(
            f"{name} must have shape [*, {', '.join(map(str, trailing))}], "
            f"got {tuple(tensor.shape)}"
        )
    if tensor.dtype != plan.spec.dtype:
        raise TypeError(f"{name} must have dtype {plan.spec.dtype}, got {tensor.dtype}")
    if tensor.device != plan.device:
        raise ValueError(f"{name} must be on {plan.device}, got {tensor.device}")
    if tensor.shape[0] < min_rows:
        raise ValueError(f"{name} must have >= {min_rows} rows, got {tensor.shape[0]}")
