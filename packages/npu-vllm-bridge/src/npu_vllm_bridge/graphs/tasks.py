"""Attention as an updatable graph task: eager call, or a recorded task under capture."""

from __future__ import annotations

from collections.abc import Mapping

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
) -> None:
    """``npu_attention.run`` for one layer, as an npu-graphs updatable task.

    Outside a capture this is a plain call. Inside one, the call is recorded with
    the step's plan as its step argument: before each replay the model runner
    hands the new step's plan to ``TaskRegistry.update``, which re-issues the op
    with the plan's host lists (NPU task update; host graphs mirror it).
    """
    call_task(
        _attention_task,
        query,
        key,
        value,
        key_cache,
        value_cache,
        out,
        step=plan,
        derive=_as_kwargs,
    )


def _attention_task(query, key, value, key_cache, value_cache, out, *, plan: AttentionPlan) -> None:
    npu_attention.run(query, key, value, key_cache, value_cache, plan, out)


def _as_kwargs(plan: AttentionPlan) -> Mapping[str, AttentionPlan]:
    return {"plan": plan}
