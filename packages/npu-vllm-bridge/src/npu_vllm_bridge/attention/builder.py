"""vLLM ``CommonAttentionMetadata`` -> one ``npu_attention`` plan per step.

:class:`BridgeBuilderBase` is the skeleton both bridge builders share: host lengths of
the step, graph padding turned into decodes that write nothing, the longest context at
capture, then the subclass's plan. :class:`BridgeMetadataBuilder` plans GQA/MQA layers;
the MLA builder (``mla_builder.py``) keeps only what MLA does differently.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

import npu_attention
from npu_attention import AttentionPlan, AttentionSpec
from npu_vllm_bridge.attention.context_parallel import DCPPlans, dcp_layout_of, plan_dcp
from npu_vllm_bridge.attention.padding_slots import SLOT_HANDLING
from npu_vllm_bridge.settings import PREFIX, current_settings
from npu_vllm_bridge.vllm_seam import builder_cudagraph_support, init_reorder_batch_threshold

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import AttentionSpec as VllmAttentionSpec

M = TypeVar("M")


@dataclass
class StepLengths:
    """A step's per-request host lengths after graph padding.

    Attributes:
        query_lens, seq_lens: per request, padding requests included.
        num_real: requests before the trailing graph padding (query length 0 from vLLM).
        longest: ``seq_lens`` are the capture's longest contexts, not the step's.
    """

    query_lens: list[int]
    seq_lens: list[int]
    num_real: int
    longest: bool

    def as_given(self, cm: CommonAttentionMetadata) -> bool:
        """Whether the lengths are vLLM's own (no padding changed, no capture lengths)."""
        return not self.longest and self.num_real == cm.num_reqs


class BridgeBuilderBase(AttentionMetadataBuilder[M], Generic[M]):
    """What both bridge builders share; subclasses give ``spec_for_layers`` (the
    npu-attention spec of their KV-cache group's layers) and ``plan_step``.

    vLLM reorders each batch so that decodes (query length 1, or up to
    ``1 + num_speculative_tokens`` with a drafter) come first, as ``npu_attention.plan``
    expects. Graph support: the attention tasks are re-issued with each step's plan
    before replay, so one graph serves every decode batch of its size; a mixed step picks
    other kernels than the decode step captured, so only uniform decode batches replay
    FULL graphs: single-token decodes, or with a drafter verify steps of ``1 + k``
    tokens per request (vLLM's ``uniform_decode_query_len``).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    spec_for_layers: ClassVar[Callable[..., Any]]

    def __init__(
        self,
        kv_cache_spec: VllmAttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Speculative decoding: verify requests of 1 + k query tokens are decodes.
        init_reorder_batch_threshold(self, 1, supports_spec_as_decode=True)
        self.max_decode_len = self.reorder_batch_threshold or 1
        # With a drafter, vLLM's host seq_lens are only upper bounds (draft steps
        # after rejected tokens lower the device ones): read the exact ones.
        self.exact_seq_lens = vllm_config.speculative_config is not None
        self.spec = type(self).spec_for_layers(
            kv_cache_spec, layer_names, vllm_config, self.max_decode_len - 1
        )
        settings = current_settings()
        self.provider = settings.attention_provider
        self.capture_longest = settings.capture_longest_context
        model_config = vllm_config.model_config
        self.max_model_len = model_config.max_model_len if model_config is not None else None
        # Decode context parallelism: this rank keeps a share of every request's KV.
        self.dcp = dcp_layout_of(vllm_config, getattr(kv_cache_spec, "dcp_sharded", True))

    @classmethod
    def get_cudagraph_support(
        cls, vllm_config: VllmConfig, kv_cache_spec: Any
    ) -> AttentionCGSupport:
        """Verify steps are uniform batches of ``1 + k`` query tokens per request, which
        the spec-decode plan serves as decodes: FULL graphs for uniform batches."""
        if vllm_config.speculative_config is not None:
            return AttentionCGSupport.UNIFORM_BATCH
        return builder_cudagraph_support(cls)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> M:
        cm = common_attn_metadata
        return self.plan_step(cm, self.step_lengths(cm, for_capture=False))

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        """Plan the dummy capture batch as if every request held the longest context,
        so that workspaces sized at capture cover every replay (host graphs re-run their
        tasks with each step's plan and keep vLLM's dummy lengths).

        Under DCP vLLM's capture batch (``prepare_dcp_dummy_context_metadata``) gives
        every dummy request the same block-table row and context length, so their
        tokens share one slot; their keys are dummies, written nowhere (slot ``-1``, as
        in vLLM's other dummy runs): a KV write takes distinct slots on the NPU."""
        cm = common_attn_metadata
        if self.dcp is not None:
            cm.slot_mapping.fill_(-1)
        return self.plan_step(cm, self.step_lengths(cm, for_capture=True))

    def step_lengths(self, cm: CommonAttentionMetadata, for_capture: bool) -> StepLengths:
        query_lens, seq_lens = host_query_and_seq_lens(cm, exact=self.exact_seq_lens)
        num_real = self.pad(query_lens, seq_lens, cm.num_actual_tokens)
        longest = for_capture and self.capture_longest
        if longest:
            seq_lens = longest_context_lens(
                query_lens, cm.block_table_tensor.shape[1], self.spec.block_size, self.dcp,
                self.max_model_len,
            )  # fmt: skip
        return StepLengths(query_lens, seq_lens, num_real, longest)

    def pad(self, query_lens: list[int], seq_lens: list[int], num_tokens: int) -> int:
        """Turn graph padding into decodes that write nothing, in place (see
        :func:`fill_padding_requests`); returns the number of real requests."""
        num_real = count_real_requests(query_lens)
        fill_padding_requests(query_lens, seq_lens, num_tokens, self.max_decode_len)
        return num_real

    def plan(
        self, cm: CommonAttentionMetadata, lengths: StepLengths, num_decodes: int
    ) -> AttentionPlan:
        """``npu_attention.plan`` of the step, on vLLM's device lengths where they hold."""
        return npu_attention.plan(
            cumulative(lengths.query_lens),
            lengths.seq_lens,
            cm.block_table_tensor[: cm.num_reqs],
            cm.slot_mapping[: cm.num_actual_tokens],
            num_decodes,
            self.spec,
            device=self.device,
            provider=self.provider,
            device_lengths=runner_lengths(cm) if lengths.as_given(cm) else None,
            **SLOT_HANDLING,
        )

    def plan_step(self, cm: CommonAttentionMetadata, lengths: StepLengths) -> M:
        """The step's metadata from its host lengths."""
        raise NotImplementedError


def host_query_and_seq_lens(
    cm: CommonAttentionMetadata, exact: bool = False
) -> tuple[list[int], list[int]]:
    """Per-request query lengths and sequence lengths as host lists.

    vLLM keeps host copies: ``seq_lens_cpu_upper_bound`` is exact without
    speculative decoding (no device sync). With a drafter it is an upper bound
    (a draft step after rejected tokens lowers only the device ``seq_lens``), so
    ``exact=True`` reads the device ``seq_lens`` (a sync on a device).
    """
    cu = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
    query_lens = [end - start for start, end in itertools.pairwise(cu)]
    host_seq_lens = None if exact else cm.seq_lens_cpu_upper_bound
    if host_seq_lens is None:
        host_seq_lens = cm.seq_lens.cpu()
    return query_lens, host_seq_lens[: cm.num_reqs].tolist()


def runner_lengths(cm: CommonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's device ``query_start_loc`` and ``seq_lens`` of the batch (int32, uploaded by
    the model runner every step): ``plan`` takes views of them instead of uploading the
    same values again. Only for batches whose lengths the bridge left as vLLM gave them."""
    return cm.query_start_loc[: cm.num_reqs + 1], cm.seq_lens[: cm.num_reqs]


def count_real_requests(query_lens: list[int]) -> int:
    """Requests before the trailing graph padding (requests of query length 0)."""
    num_real = len(query_lens)
    while num_real and query_lens[num_real - 1] == 0:
        num_real -= 1
    return num_real


def fill_padding_requests(
    query_lens: list[int], seq_lens: list[int], num_tokens: int, decode_len: int = 1
) -> bool:
    """Turn graph padding into decodes that write nothing, in place; whether any
    request changed.

    A padded FULL-graph batch ends with requests of query length 0 (block
    table rows of the null block) and tokens past the last request (slot -1).
    Each padding request takes ``decode_len`` padding tokens (``1 + k`` in the
    verify step of ``k`` speculative tokens, when the spare tokens are exactly
    that many per padding request; else 1) and attends as many keys of the
    null block, so the padded batch is a uniform decode batch of the captured
    size whose cumulative query offsets are multiples of ``decode_len``; its
    outputs are discarded by vLLM.
    """
    num_real = count_real_requests(query_lens)
    spare_tokens = num_tokens - sum(query_lens)
    num_padding = len(query_lens) - num_real
    if num_padding == 0 or spare_tokens < num_padding:
        return False
    pad_len = decode_len if spare_tokens >= num_padding * decode_len else 1
    for i in range(num_real, len(query_lens)):
        query_lens[i] = pad_len
        seq_lens[i] = pad_len
    return True


def count_leading_decodes(query_lens: list[int], max_decode_len: int = 1) -> int:
    """Requests of 1 to ``max_decode_len`` query tokens at the head of the batch
    (vLLM puts decodes first; verify steps bring ``1 + num_speculative_tokens``)."""
    count = 0
    for query_len in query_lens:
        if not 1 <= query_len <= max_decode_len:
            break
        count += 1
    return count


def cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for length in lengths:
        out.append(out[-1] + length)
    return out


def longest_context_lens(
    query_lens: list[int],
    table_width: int,
    block_size: int,
    dcp: Any,
    max_model_len: int | None,
) -> list[int]:
    """Capture-time KV lengths: every request that brings tokens holds the longest
    context its block table (``table_width`` blocks) addresses, up to ``max_model_len``;
    padding requests (no tokens) hold none."""
    # Under DCP a block-table entry covers block_size tokens of every rank.
    longest = table_width * block_size * (dcp.size if dcp else 1)
    if max_model_len is not None:
        longest = min(longest, max_model_len)
    return [max(longest, q) if q else 0 for q in query_lens]


def attention_spec_for_layers(
    kv_cache_spec: VllmAttentionSpec,
    layer_names: list[str],
    vllm_config: VllmConfig,
    num_speculative_tokens: int = 0,
) -> AttentionSpec:
    """The ``npu_attention.AttentionSpec`` shared by the layers of one KV-cache group.

    Raises:
        ValueError: the layers disagree on heads, scale, window or soft cap (one
            plan serves the whole group).
    """
    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    if not layers:
        raise ValueError(f"no attention layers named {layer_names} in the model")
    shapes = {
        (impl.num_heads, impl.scale, impl.sliding_window, impl.logits_soft_cap, impl.kv_cache_dtype)
        for impl in (layer.impl for layer in layers.values())
    }
    if len(shapes) != 1:
        raise ValueError(
            f"{PREFIX} plans attention once per KV-cache group, but the layers "
            f"{sorted(layers)} differ in (num_heads, scale, sliding_window, soft_cap, "
            f"kv_cache_dtype): {sorted(shapes, key=str)}"
        )
    num_heads, scale, sliding_window, soft_cap, kv_cache_dtype = shapes.pop()
    # An 8-bit cache's spec holds the page dtype (uint8 / int8); attention runs in the model's.
    dtype = kv_cache_spec.dtype if kv_cache_dtype == "auto" else vllm_config.model_config.dtype
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=kv_cache_spec.num_kv_heads,
        head_size=kv_cache_spec.head_size,
        block_size=kv_cache_spec.block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        causal=True,
        sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
        scale=scale,
        num_speculative_tokens=num_speculative_tokens,
    )


@dataclass
class BridgeAttentionMetadata:
    """What every attention layer of one KV-cache group reads in one step.

    Attributes:
        plan: the step's ``npu_attention`` plan (host lists and device tensors); under
            decode context parallelism, the new tokens' plan (``dcp.new_plan``).
        num_actual_tokens: query rows in the step, graph padding included.
        dcp: the step's plans under decode context parallelism, else ``None``.
    """

    plan: AttentionPlan
    num_actual_tokens: int
    dcp: DCPPlans | None = None


class BridgeMetadataBuilder(BridgeBuilderBase[BridgeAttentionMetadata]):
    """Builds a :class:`BridgeAttentionMetadata` per step for GQA/MQA layers."""

    spec_for_layers = staticmethod(attention_spec_for_layers)

    def plan_step(
        self, cm: CommonAttentionMetadata, lengths: StepLengths
    ) -> BridgeAttentionMetadata:
        query_lens = lengths.query_lens
        num_decodes = count_leading_decodes(query_lens, self.max_decode_len)
        if self.dcp is None:
            plan = self.plan(cm, lengths, num_decodes)
            return BridgeAttentionMetadata(plan, cm.num_actual_tokens)
        plans = plan_dcp(
            cumulative(query_lens),
            query_lens,
            lengths.seq_lens,
            cm.block_table_tensor[: cm.num_reqs],
            cm.slot_mapping[: cm.num_actual_tokens],
            num_decodes,
            self.spec,
            self.dcp,
            device=self.device,
            provider=self.provider,
        )
        return BridgeAttentionMetadata(plans.new_plan, cm.num_actual_tokens, plans)
