"""Attention as an updatable graph task: eager call, or a recorded task under capture."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import npu_attention
from npu_attention import AttentionPlan
from npu_graphs import call_task


def run_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    out: torch.Tensor,
    *,
    layer_name: str | None = None,
    step_metadata: Mapping[str, Any] | None = None,
) -> None:
    """``npu_attention.run`` for one layer, as an npu-graphs updatable task.

    Outside a capture this is a plain call. Inside one, the call is recorded with a
    step argument that the model runner hands to ``TaskRegistry.update`` before each
    replay, which re-issues the op with the new step's host lists (NPU task update;
    host graphs mirror it):

    * with ``layer_name``: the step is the per-layer metadata of the step
      (``step_metadata``, vLLM's ``{layer_name: metadata}``), and the task takes its
      own layer's plan from it, so that each KV-cache group's layers are updated with
      their group's plan;
    * without: the step is ``plan`` itself (one plan per step).
    """
    if layer_name is None:
        step, derive = plan, _as_kwargs
    else:
        step = step_metadata if step_metadata is not None else {layer_name: _Planned(plan)}
        derive = LayerPlan(layer_name)
    call_task(
        _attention_task, query, key, value, key_cache, value_cache, out, step=step, derive=derive
    )


def _attention_task(query, key, value, key_cache, value_cache, out, *, plan: AttentionPlan) -> None:
    npu_attention.run(query, key, value, key_cache, value_cache, plan, out)


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
    *,
    layer_name: str,
    step_metadata: Mapping[str, Any],
) -> None:
    """A layer's two attention calls under decode context parallelism, as one
    updatable task whose step arguments are the layer's ``DCPPlans`` (taken from the
    step's ``{layer_name: metadata}``): the gathered query ``q_all`` over this rank's
    context share (``context_plan``: the rank's local context lengths; it also writes
    the rank's share of the new K/V), and ``query`` over the step's new tokens
    (``new_plan``), each with its log-sum-exp."""
    call_task(
        _dcp_attention_task,
        q_all,
        query,
        key,
        value,
        key_cache,
        value_cache,
        context_out,
        context_lse,
        new_out,
        new_lse,
        step=step_metadata,
        derive=LayerDCPPlans(layer_name),
    )


def _dcp_attention_task(
    q_all,
    query,
    key,
    value,
    key_cache,
    value_cache,
    context_out,
    context_lse,
    new_out,
    new_lse,
    *,
    context_plan: AttentionPlan,
    new_plan: AttentionPlan,
) -> None:
    run = npu_attention.run
    run(q_all, key, value, key_cache, value_cache, context_plan, context_out, lse=context_lse)
    run(query, key, value, None, None, new_plan, new_out, lse=new_lse)


def _as_kwargs(plan: AttentionPlan) -> Mapping[str, AttentionPlan]:
    return {"plan": plan}


class LayerPlan:
    """Derives one layer's step arguments from the step's ``{layer_name: metadata}``."""

    __slots__ = ("layer_name",)

    def __init__(self, layer_name: str) -> None:
        self.layer_name = layer_name

    def __call__(self, step_metadata: Mapping[str, Any]) -> Mapping[str, AttentionPlan]:
        metadata = step_metadata.get(self.layer_name)
        if metadata is None:
            raise ValueError(
                f"the step's attention metadata has no entry for layer {self.layer_name!r} "
                f"(it has {sorted(step_metadata)[:4]}...)"
            )
        return self.step_kwargs(metadata)

    def step_kwargs(self, metadata: Any) -> Mapping[str, AttentionPlan]:
        return {"plan": metadata.plan}


class LayerDCPPlans(LayerPlan):
    """Derives one layer's DCP plans (``context_plan``, ``new_plan``) from the step."""

    __slots__ = ()

    def step_kwargs(self, metadata: Any) -> Mapping[str, AttentionPlan]:
        plans = getattr(metadata, "dcp", None)
        if plans is None:
            raise ValueError(
                f"layer {self.layer_name!r} was captured with decode context parallelism, "
                "but the step's metadata has no DCP plans"
            )
        return {"context_plan": plans.context_plan, "new_plan": plans.new_plan}


class _Planned:
    __slots__ = ("plan",)

    def __init__(self, plan: AttentionPlan) -> None:
        self.plan = plan
