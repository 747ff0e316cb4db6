"""vLLM ``AttentionImpl``: one layer's attention through ``npu_attention.run``."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionLayer, AttentionType

from npu_attention.run import check_scales
from npu_vllm_bridge.attention.builder import BridgeAttentionMetadata
from npu_vllm_bridge.attention.capabilities import refuse_layer_options
from npu_vllm_bridge.attention.context_parallel import dcp_attention
from npu_vllm_bridge.attention.kv_cache import quantized_kv_cache, split_kv_cache
from npu_vllm_bridge.attention.tasks import contiguous_rows, run_attention
from npu_vllm_bridge.settings import PREFIX, current_settings
from npu_vllm_bridge.vllm_seam import layer_kv_scales


class BridgeAttentionImpl(AttentionImpl[BridgeAttentionMetadata]):
    """Writes the step's K/V into the paged cache and attends, for one layer.

    Options the kernels do not have (ALiBi, attention sinks, KV cache kinds the
    provider does not take, encoder attention) are refused here, when vLLM builds the
    layer. An 8-bit cache (``kv_cache_dtype``) is read and written through
    npu-attention's quantized kinds: per-tensor scales are the layer's ``_k_scale`` /
    ``_v_scale`` (a checkpoint's, else vLLM's default 1.0), per-token-head scales sit
    in the pages.

    Decode context parallelism: every npu-attention provider the bridge plans with
    returns the natural-log LSE, so vLLM may shard the KV cache over its DCP group
    (``attention/context_parallel.py`` runs the layer then).
    """

    # vLLM's DCP flags (AttentionImplBase): the LSE comes back for decodes (and every
    # other batch), in natural-log units.
    can_return_lse_for_decode: bool = True
    lse_base_on_e: bool = True
    supports_dcp: bool = True
    supports_pcp: bool = False  # vLLM 0.32 runs prefill context parallelism for MLA only

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra_impl_args: Any,
    ) -> None:
        refuse_layer_options(
            alibi_slopes=alibi_slopes,
            kv_cache_dtype=kv_cache_dtype,
            attn_type=attn_type,
            extra=extra_impl_args,
        )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap or None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.kv_cache_split = current_settings().kv_cache_split
        if self.dcp_world_size > 1:  # set by vLLM's AttentionImplBase.__new__
            refuse_under_dcp(self.dcp_world_size, sliding_window, kv_sharing_target_layer_name)
        if kv_cache_dtype != "auto" and self.dcp_world_size > 1:
            raise ValueError(
                f"{PREFIX} keeps an 8-bit KV cache (kv_cache_dtype={kv_cache_dtype!r}) "
                "without decode context parallelism; got decode_context_parallel_size="
                f"{self.dcp_world_size}"
            )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: BridgeAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer.

        Args:
            query: ``[num_tokens, num_heads, head_size]``.
            key, value: ``[num_tokens, num_kv_heads, head_size]``; ``None`` for a
                layer that shares another layer's cache (nothing is written).
            kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``.
            attn_metadata: the step's metadata; ``None`` in vLLM's profiling run.
            output: ``[num_tokens, num_heads, head_size]``, written in place.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{PREFIX} does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling run: no step to attend
            return output.zero_()
        scales: dict[str, torch.Tensor] = {}
        if self.kv_cache_dtype == "auto":
            key_cache, value_cache = split_kv_cache(kv_cache, self.head_size, self.kv_cache_split)
        else:
            key_cache, value_cache, k_scale, v_scale = quantized_kv_cache(
                kv_cache, self.head_size, self.kv_cache_dtype, self.kv_cache_split
            )
            if k_scale is None:  # per tensor: the layer's
                k_scale, v_scale = layer_kv_scales(layer)
            scales = {"k_scale": k_scale, "v_scale": v_scale}
        if attn_metadata.plan.provider.contiguous_inputs:
            query, key, value = contiguous_rows(query, key, value)
        if attn_metadata.dcp is not None:
            from vllm.distributed.parallel_state import get_dcp_group

            dcp_attention(
                query, key, value, key_cache, value_cache, output, get_dcp_group(),
                attn_metadata, layer_name=layer.layer_name,
            )  # fmt: skip
            return output
        if self.kv_sharing_target_layer_name is not None:
            key = value = None
        if scales and key is not None and _writes_before_the_task(attn_metadata.plan):
            write_quantized_kv(key, value, key_cache, value_cache, attn_metadata.plan, **scales)
            key = value = None
        run_attention(
            query, key, value, key_cache, value_cache, output, attn_metadata,
            layer_name=layer.layer_name, **scales,
        )  # fmt: skip
        return output


def _writes_before_the_task(plan: Any) -> bool:
    """Whether a quantized write goes before the attention task, as a graph's own ops: a
    provider whose write quantizes with device work a task update cannot re-issue
    (``quantized_write_outside_task``), on a step whose attention reads the pages (a
    prefill without context attends over its own rows: the write stays in the task)."""
    return getattr(plan.provider, "quantized_write_outside_task", False) and plan.has_context


def write_quantized_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: Any,
    *,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """The step's K/V into the 8-bit pages (scales checked as ``npu_attention.run`` does)."""
    scales = check_scales(k_scale, v_scale, key_cache, plan)
    plan.provider.write_kv(key, value, key_cache, value_cache, plan, scales=scales)


def refuse_under_dcp(
    dcp_size: int, sliding_window: int | None, kv_sharing_target_layer_name: str | None
) -> None:
    """Raise ``ValueError`` for layer options the bridge's DCP attention cannot run."""
    if sliding_window is not None:
        raise ValueError(
            f"{PREFIX} runs decode context parallelism (decode_context_parallel_size="
            f"{dcp_size}) for full attention only, got a layer with sliding_window="
            f"{sliding_window} (a rank's KV share keeps no global positions); use "
            "decode_context_parallel_size=1"
        )
    if kv_sharing_target_layer_name is not None:
        raise ValueError(
            f"{PREFIX} does not run decode context parallelism (decode_context_"
            f"parallel_size={dcp_size}) with layers that share another layer's KV cache "
            f"(kv_sharing_target_layer_name={kv_sharing_target_layer_name!r})"
        )
