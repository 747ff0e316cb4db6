"""MLA latent-cache write, absorbed decode and prefill as npu-graphs updatable tasks.

The same contract as the GQA attention task (``graphs/tasks.py``): outside a capture
each function is a plain call of ``npu_attention``'s MLA API; inside one it is
recorded as a task whose step argument is the step's per-layer metadata
(``{layer_name: metadata}``), from which the task takes its own layer's plan. A
task update before replay re-issues it with the new step's host arguments: the
per-request KV lengths (0 for graph-padding requests), the cumulative query lengths
(speculative decodes bring ``1 + k`` tokens per request) and the block table, all
held by the plan (``seq_lens_host``, ``cu_seqlens_q_host``, ``block_tables``). Without
the update a replay runs the captured step's arguments, as an NPU task would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from npu_attention import AttentionPlan
from npu_attention.mla import LatentCache, mla_decode, mla_prefill, mla_write_cache
from npu_graphs import call_task
from npu_vllm_bridge.graphs.tasks import LayerPlan

# A FULL decode graph records two tasks per MLA layer: the latent write, the decode.
MLA_TASKS_PER_LAYER = 2


def count_own_mla_tasks(vllm_config: Any, model: torch.nn.Module) -> int:
    """Updatable tasks the MLA layers of ``model`` itself record in one FULL decode
    graph (a drafter's layers run in the drafter's forwards, not in this graph)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layers = get_layers_from_vllm_config(vllm_config, MLAAttention)
    own = {id(module) for module in model.modules()}
    return MLA_TASKS_PER_LAYER * sum(id(layer) in own for layer in layers.values())


def run_mla_write_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: LatentCache,
    plan: AttentionPlan,
    *,
    layer_name: str,
    step_metadata: Mapping[str, Any] | None = None,
) -> None:
    """``mla_write_cache`` of one layer (slots from the plan), as an updatable task."""
    call_task(
        _write_task, kv_c, k_pe, cache, step=_step(plan, layer_name, step_metadata),
        derive=LayerPlan(layer_name),
    )  # fmt: skip


def run_mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentCache,
    plan: AttentionPlan,
    out: torch.Tensor,
    *,
    lse: torch.Tensor | None = None,
    layer_name: str,
    step_metadata: Mapping[str, Any] | None = None,
) -> None:
    """``mla_decode`` (absorbed, decodes and speculative decodes; with ``lse``, the
    rows' log-sum-exp too) of one layer, as an updatable task."""
    step = _step(plan, layer_name, step_metadata)
    if lse is None:
        call_task(
            _decode_task, q_latent, q_rope, cache, out, step=step, derive=LayerPlan(layer_name)
        )
    else:
        call_task(
            _decode_lse_task, q_latent, q_rope, cache, out, lse, step=step,
            derive=LayerPlan(layer_name),
        )  # fmt: skip


def run_mla_prefill(
    query: torch.Tensor,
    cache: LatentCache,
    plan: AttentionPlan,
    kv_up_proj: Any,
    out: torch.Tensor,
    *,
    layer_name: str,
    step_metadata: Mapping[str, Any] | None = None,
) -> None:
    """``mla_prefill`` (non-absorbed) of one layer, as an updatable task."""
    call_task(
        _prefill_task, query, cache, kv_up_proj, out, step=_step(plan, layer_name, step_metadata),
        derive=LayerPlan(layer_name),
    )  # fmt: skip


def _write_task(kv_c, k_pe, cache, *, plan: AttentionPlan) -> None:
    mla_write_cache(kv_c, k_pe, cache, plan)


def _decode_task(q_latent, q_rope, cache, out, *, plan: AttentionPlan) -> None:
    mla_decode(q_latent, q_rope, cache, plan, out)


def _decode_lse_task(q_latent, q_rope, cache, out, lse, *, plan: AttentionPlan) -> None:
    mla_decode(q_latent, q_rope, cache, plan, out, lse=lse)


def _prefill_task(query, cache, kv_up_proj, out, *, plan: AttentionPlan) -> None:
    mla_prefill(query, cache, plan, kv_up_proj, out)


def _step(
    plan: AttentionPlan, layer_name: str, step_metadata: Mapping[str, Any] | None
) -> Mapping[str, Any]:
    return step_metadata if step_metadata is not None else {layer_name: _Planned(plan)}


class _Planned:
    __slots__ = ("plan",)

    def __init__(self, plan: AttentionPlan) -> None:
        self.plan = plan
