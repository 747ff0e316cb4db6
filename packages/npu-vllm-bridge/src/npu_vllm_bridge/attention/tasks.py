"""Each attention op of a layer as an npu-graphs updatable task.

Outside a capture each function here is a plain call of npu-attention. Inside one it
is recorded as a task named after its layer (a layer's tasks share its name), whose step
is the layer's ``attn_metadata``; before each replay the graph wrapper hands the registry the step's
``{layer_name: attn_metadata}`` and every task is re-issued with its own layer's plan
(NPU task update; host graphs mirror it). Without the update a replay runs the
captured step's plan, as an NPU task would.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.mla_attention import MLAAttention

import npu_attention
from npu_attention import AttentionPlan
from npu_attention.mla import (
    LatentCache,
    mla_decode,
    mla_finish_decode,
    mla_prefill,
    mla_write_cache,
)
from npu_graphs import call_task

# A FULL decode graph records two tasks per MLA layer: the latent write, the decode.
MLA_TASKS_PER_LAYER = 2


def count_attention_tasks(vllm_config: Any, model: torch.nn.Module) -> int:
    """Tasks one FULL graph of ``model`` records: one per attention layer of ``model``
    itself, ``MLA_TASKS_PER_LAYER`` per MLA layer (a drafter's layers are in the same
    config but run in the drafter's forwards, not in this model's graphs)."""
    own = {id(module) for module in model.modules()}

    def count(layer_type: type) -> int:
        layers = get_layers_from_vllm_config(vllm_config, layer_type)
        return sum(id(layer) in own for layer in layers.values())

    return count(Attention) + MLA_TASKS_PER_LAYER * count(MLAAttention)


def plan_args(attn_metadata: Any) -> dict[str, AttentionPlan]:
    """A layer's step arguments: its plan."""
    return {"plan": attn_metadata.plan}


def mla_write_args(attn_metadata: Any) -> dict[str, AttentionPlan]:
    """An MLA layer's write arguments: under PCP the gathered write's plan, else its plan."""
    write_plan = attn_metadata.write_plan
    return {"plan": attn_metadata.plan if write_plan is None else write_plan}


def dcp_plan_args(attn_metadata: Any) -> dict[str, AttentionPlan]:
    """A layer's step arguments under decode context parallelism: its two plans."""
    plans = attn_metadata.dcp
    if plans is None:
        raise ValueError(
            "this layer was captured with decode context parallelism, but the step's "
            "attention metadata has no DCP plans"
        )
    return {"context_plan": plans.context_plan, "new_plan": plans.new_plan}


def contiguous_rows(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Each tensor contiguous (itself when it already is; ``None`` stays ``None``).

    For providers that read their inputs as they are (``contiguous_inputs``): vLLM's
    value (and, after an in-place rotary kernel, query and key) is a strided view of the
    QKV projection's output. The copy is made here, before the attention task, so that a
    graph records it as one of its own ops; inside the task an NPU task update would
    re-run it outside the graph (on V1 before the replay, reading the last step's rows)."""
    return [t if t is None or t.is_contiguous() else t.contiguous() for t in tensors]


def run_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    attn_metadata: Any,
    *,
    layer_name: str,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """``npu_attention.run`` of one layer (K/V write and attention) as a task. An 8-bit
    cache's scales are static arguments: the layer's per-tensor scales, or views of the
    per-token-head scales the step writes into its pages."""
    call_task(
        _attention, query, key, value, key_cache, value_cache, out, k_scale, v_scale,
        step=attn_metadata, derive=plan_args, name=layer_name,
    )  # fmt: skip


def _attention(
    query, key, value, key_cache, value_cache, out, k_scale, v_scale, *, plan: AttentionPlan
) -> None:  # fmt: skip
    npu_attention.run(
        query, key, value, key_cache, value_cache, plan, out, k_scale=k_scale, v_scale=v_scale
    )


def run_dcp_attention(
    q_all: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    context_out: torch.Tensor,
    context_lse: torch.Tensor,
    new_out: torch.Tensor,
    new_lse: torch.Tensor,
    attn_metadata: Any,
    *,
    layer_name: str,
) -> None:
    """A layer's two attention calls under decode context parallelism, as one task:
    the gathered query ``q_all`` over this rank's context share (``context_plan``,
    which also writes the rank's share of the new K/V) into ``context_out`` and
    ``context_lse``, and ``query`` over the step's new tokens (``new_plan``) into
    ``new_out`` and ``new_lse``."""
    call_task(
        _dcp_attention, q_all, query, key, value, key_cache, value_cache,
        context_out, context_lse, new_out, new_lse, step=attn_metadata, derive=dcp_plan_args, name=layer_name,
    )  # fmt: skip


def _dcp_attention(
    q_all, query, key, value, key_cache, value_cache, context_out, context_lse, new_out,
    new_lse, *, context_plan: AttentionPlan, new_plan: AttentionPlan,
) -> None:  # fmt: skip
    run = npu_attention.run
    run(q_all, key, value, key_cache, value_cache, context_plan, context_out, lse=context_lse)
    run(query, key, value, None, None, new_plan, new_out, lse=new_lse)


def run_mla_write_cache(
    kv_c: torch.Tensor, k_pe: torch.Tensor, cache: LatentCache, attn_metadata: Any, *,
    layer_name: str, k_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """``mla_write_cache`` of one layer (slots from the plan; under PCP, rows and slots
    of every rank, from ``write_plan``) as a task."""
    call_task(
        _mla_write, kv_c, k_pe, cache, k_scale,
        step=attn_metadata, derive=mla_write_args, name=layer_name,
    )  # fmt: skip


def _mla_write(kv_c, k_pe, cache, k_scale, *, plan: AttentionPlan) -> None:
    mla_write_cache(kv_c, k_pe, cache, plan, k_scale=k_scale)


def run_mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentCache,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    attn_metadata: Any,
    *,
    layer_name: str,
    k_scale: torch.Tensor | None = None,
) -> None:
    """``mla_decode`` of one layer (absorbed; with ``lse``, the rows' log-sum-exp too):
    the provider's kernel as a task (an fp8 cache's scale a static argument), then its
    finish (copies, masking) after the task, so that a task update re-issues the kernel
    alone; in a graph the finish replays as the graph's own ops."""
    call_task(
        _mla_decode, q_latent, q_rope, cache, out, lse, k_scale,
        step=attn_metadata, derive=plan_args, name=layer_name,
    )  # fmt: skip
    mla_finish_decode(q_latent, attn_metadata.plan, out, lse=lse)


def _mla_decode(q_latent, q_rope, cache, out, lse, k_scale, *, plan: AttentionPlan) -> None:
    mla_decode(q_latent, q_rope, cache, plan, out, lse=lse, k_scale=k_scale, finish=False)


def run_mla_prefill(
    query: torch.Tensor,
    cache: LatentCache,
    kv_up_proj: Any,
    out: torch.Tensor,
    attn_metadata: Any,
    *,
    layer_name: str,
    k_scale: torch.Tensor | None = None,
) -> None:
    """``mla_prefill`` of one layer (non-absorbed) as a task; an fp8 cache's scale is a
    static argument."""
    call_task(
        _mla_prefill, query, cache, kv_up_proj, out, k_scale,
        step=attn_metadata, derive=plan_args, name=layer_name,
    )  # fmt: skip


def _mla_prefill(query, cache, kv_up_proj, out, k_scale, *, plan: AttentionPlan) -> None:
    mla_prefill(query, cache, plan, kv_up_proj, out, k_scale=k_scale)
