"""vLLM ``CommonAttentionMetadata`` -> one MLA ``npu_attention`` plan per step.

vLLM's MLA layer (``MLAAttention.forward_impl``) splits each step's rows itself: the
first ``num_decode_tokens`` go to ``impl.forward_mqa`` (absorbed decode), the rest to
``impl.forward_mha`` (prefill). The metadata here carries those counts for the layer
and the step's plan for the impl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata

from npu_attention import AttentionPlan
from npu_attention.context_parallel import pcp_write_plan
from npu_attention.mla import MLASpec
from npu_vllm_bridge.attention.builder import (
    BridgeBuilderBase,
    StepLengths,
    count_leading_decodes,
    count_real_requests,
    fill_padding_requests,
)
from npu_vllm_bridge.attention.mla_context_parallel import plan_mla_dcp
from npu_vllm_bridge.settings import PREFIX

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import AttentionSpec as VllmAttentionSpec


@dataclass
class MLARows:
    """Rows of one kind (decode or prefill) in a step; vLLM's layer only checks presence
    (and, under DCP, hands ``seq_lens`` to the DCP manager, whose bridge version
    ignores it)."""

    num_reqs: int
    num_tokens: int
    seq_lens: torch.Tensor | None = None


@dataclass
class BridgeMLAMetadata:
    """What every MLA layer of one KV-cache group reads in one step.

    Attributes:
        plan: the step's ``npu_attention`` plan for an ``MLASpec``. Graph-padding
            requests are decodes of ``1 + k`` (or 1) padding tokens over as many keys
            of the null block, as in GQA attention (``fill_padding_requests``).
        num_actual_tokens: query rows in the step, graph padding included.
        num_reqs: requests, graph padding included.
        num_decodes: leading requests of at most ``1 + num_speculative_tokens`` query
            tokens (graph-padding requests join them in a decode-only step).
        num_decode_tokens: rows vLLM's layer sends to ``forward_mqa``; in a step without
            prefills, every row (graph padding included, its output zero).
        num_prefills: requests after the decodes.
        decode, prefill: present when the step has rows of that kind (vLLM's layer asserts
            ``decode is not None`` before ``forward_mqa``).
        query_start_loc: vLLM's device query offsets; under DCP vLLM's layer hands
            them to the DCP manager, whose bridge version does not read them.
        write_plan: under prefill context parallelism, the plan of the latent write
            (``pcp_write_plan``): vLLM's layer writes the rows of every PCP rank, at the
            group's gathered slot mapping; otherwise ``None`` and ``plan`` writes.
    """

    plan: AttentionPlan
    num_actual_tokens: int
    num_reqs: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    decode: MLARows | None
    prefill: MLARows | None
    query_start_loc: torch.Tensor | None = None
    write_plan: AttentionPlan | None = None


def pad_requests(
    query_lens: list[int], seq_lens: list[int], num_tokens: int, max_decode_len: int
) -> int:
    """Turn the trailing graph-padding requests (query length 0) into decodes of the
    spare tokens over the null block, in place (``fill_padding_requests``: ``1 + k``
    tokens and keys each in a padded verify step, else 1), and return the number of
    real requests. Ascend's fused MLA op takes 1 to 16 query tokens per request, so
    padding requests bring tokens; any left without (too few spare tokens) get KV
    length 0."""
    num_real = count_real_requests(query_lens)
    fill_padding_requests(query_lens, seq_lens, num_tokens, max_decode_len)
    for i in range(num_real, len(query_lens)):
        if query_lens[i] == 0:
            seq_lens[i] = 0
    return num_real


def mla_spec_for_layers(
    kv_cache_spec: VllmAttentionSpec,
    layer_names: list[str],
    vllm_config: VllmConfig,
    num_speculative_tokens: int = 0,
) -> MLASpec:
    """The ``npu_attention`` ``MLASpec`` shared by the MLA layers of one KV-cache group.

    Raises:
        ValueError: no MLA layers of those names, or layers that disagree on heads,
            widths or scale (one plan serves the whole group).
    """
    layers = vllm_config.compilation_config.static_forward_context
    shapes = set()
    for name in layer_names:
        layer = layers.get(name)
        if layer is None or not hasattr(layer, "kv_lora_rank"):
            raise ValueError(f"no MLA attention layer named {name!r} in the model")
        shapes.add(
            (
                layer.num_heads,
                layer.kv_lora_rank,
                layer.qk_nope_head_dim,
                layer.qk_rope_head_dim,
                layer.v_head_dim,
                float(layer.scale),
                getattr(layer, "kv_cache_dtype", "auto"),
            )
        )
    if len(shapes) != 1:
        raise ValueError(
            f"{PREFIX} plans MLA once per KV-cache group, but the layers "
            f"{sorted(layer_names)} differ in (num_heads, kv_lora_rank, qk_nope_head_dim, "
            f"qk_rope_head_dim, v_head_dim, scale, kv_cache_dtype): {sorted(shapes)}"
        )
    heads, rank, nope, rope, v_dim, scale, kv_cache_dtype = shapes.pop()
    # An fp8 cache's spec holds the page dtype (uint8); attention runs in the model's.
    dtype = kv_cache_spec.dtype if kv_cache_dtype == "auto" else vllm_config.model_config.dtype
    if kv_cache_spec.head_size != rank + rope:
        raise ValueError(
            f"the MLA KV cache holds rows of {kv_cache_spec.head_size}, expected "
            f"kv_lora_rank + qk_rope_head_dim = {rank + rope}"
        )
    return MLASpec(
        num_heads=heads,
        kv_lora_rank=rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
        block_size=kv_cache_spec.block_size,
        dtype=dtype,
        scale=scale,
        num_speculative_tokens=num_speculative_tokens,
        kv_cache_dtype=kv_cache_dtype,
    )


class BridgeMLAMetadataBuilder(BridgeBuilderBase[BridgeMLAMetadata]):
    """Builds a :class:`BridgeMLAMetadata` per step (the skeleton is the GQA builder's).

    What MLA does differently: graph-padding requests left without tokens get KV length
    0 (Ascend's fused MLA op takes 1 to 16 query tokens per request), padding joins the
    decodes of a decode-only step, the metadata carries vLLM's decode/prefill row
    counts, and under DCP every row is a one-token absorbed decode (``plan_mla_dcp``).
    """

    spec_for_layers = staticmethod(mla_spec_for_layers)

    def pad(self, query_lens: list[int], seq_lens: list[int], num_tokens: int) -> int:
        return pad_requests(query_lens, seq_lens, num_tokens, self.max_decode_len)

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.pcp_size = vllm_config.parallel_config.prefill_context_parallel_size
        # Under DCP: the rows' block tables, gathered in place every step (plan_mla_dcp).
        self.max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.dcp_table_rows: torch.Tensor | None = None

    def plan_step(self, cm: CommonAttentionMetadata, lengths: StepLengths) -> BridgeMLAMetadata:
        """Under PCP vLLM hands each rank a batch of its own: each chunk of a prefill is
        a request whose ``seq_lens`` end at the chunk, so ``plan`` attends it causally
        over the whole sequence; only the write differs (``write_plan``)."""
        query_lens, seq_lens, num_real = lengths.query_lens, lengths.seq_lens, lengths.num_real
        if self.dcp is not None:
            return self._plan_dcp(cm, query_lens[:num_real], seq_lens[:num_real])
        num_decodes = count_leading_decodes(query_lens, self.max_decode_len)
        if num_decodes == num_real:
            num_decodes = len(query_lens)  # graph padding joins a decode-only step
        plan = self.plan(cm, lengths, num_decodes)
        decode_rows = plan.num_decode_tokens if plan.num_prefills else cm.num_actual_tokens
        prefill_rows = plan.num_actual_tokens - plan.num_decode_tokens
        return BridgeMLAMetadata(
            plan=plan,
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=cm.num_reqs,
            num_decodes=plan.num_decodes,
            num_decode_tokens=decode_rows,
            num_prefills=plan.num_prefills,
            decode=MLARows(plan.num_decodes, decode_rows) if decode_rows else None,
            prefill=MLARows(plan.num_prefills, prefill_rows) if plan.num_prefills else None,
            write_plan=pcp_write_plan(plan, cm.slot_mapping) if self.pcp_size > 1 else None,
        )

    def _plan_dcp(
        self, cm: CommonAttentionMetadata, query_lens: list[int], seq_lens: list[int]
    ) -> BridgeMLAMetadata:
        """Under DCP every row is a one-token absorbed decode (``plan_mla_dcp``)."""
        tokens = cm.num_actual_tokens
        tables = cm.block_table_tensor
        if self.dcp_table_rows is None:
            rows = max(self.max_tokens, tokens)
            self.dcp_table_rows = tables.new_zeros(rows, tables.shape[1])
        plan = plan_mla_dcp(
            query_lens,
            seq_lens,
            tables[: len(query_lens)],
            cm.slot_mapping[:tokens],
            tokens,
            self.spec,
            self.dcp,
            device=self.device,
            provider=self.provider,
            table_rows=self.dcp_table_rows,
        )
        return BridgeMLAMetadata(
            plan=plan,
            num_actual_tokens=tokens,
            num_reqs=tokens,
            num_decodes=tokens,
            num_decode_tokens=tokens,
            num_prefills=0,
            decode=MLARows(tokens, tokens),
            prefill=None,
            query_start_loc=cm.query_start_loc,
        )
