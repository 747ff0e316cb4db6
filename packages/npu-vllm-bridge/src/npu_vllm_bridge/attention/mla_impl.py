"""vLLM ``MLAAttentionImpl`` over npu-attention's MLA API, for one layer.

vLLM's ``MLAAttention`` layer keeps the model-side work: it absorbs ``W_UK`` into the
decode queries, up-projects the decode output with ``W_UV``, and splits each step's
rows between ``forward_mqa`` (decodes first) and ``forward_mha``. This impl writes the
latents (``do_kv_cache_update``) and attends:

* ``forward_mqa``: ``npu_attention.mla_decode`` over the latent cache, out in latent
  space (``[B, N, kv_lora_rank]``), speculative tokens causal among themselves;
* ``forward_mha``: ``npu_attention.mla_prefill`` with ``kv_b_proj`` as the
  up-projection of cached latents (context and new tokens alike), so prefix-cache
  hits and chunked prefills need no context workspace.

Under decode context parallelism every row goes to ``forward_mqa``: the queries of
the whole DCP group's heads attend over this rank's latents, and the output comes
back with its log-sum-exp for vLLM's layer to combine (``mla_context_parallel.py``).

Each call is an npu-graphs updatable task (``attention/tasks.py``) whose step is the
layer's metadata.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
from vllm.v1.attention.backend import AttentionLayer, AttentionType

from npu_attention.mla import LatentCache, latent_cache_planes, split_latent_cache
from npu_vllm_bridge.attention.capabilities import refuse_layer_options
from npu_vllm_bridge.attention.mla_builder import BridgeMLAMetadata
from npu_vllm_bridge.attention.mla_context_parallel import BridgeMLADCP
from npu_vllm_bridge.attention.tasks import (
    contiguous_rows,
    run_mla_decode,
    run_mla_prefill,
    run_mla_write_cache,
)
from npu_vllm_bridge.settings import PREFIX, current_settings
from npu_vllm_bridge.vllm_seam import set_mla_dcp_manager

# The arguments vLLM's MLA impl takes (the layer may pass more; they are not its).
_BASE_PARAMETERS = frozenset(inspect.signature(MLACommonImpl.__init__).parameters) - {"self"}


class BridgeMLAImpl(MLACommonImpl[BridgeMLAMetadata]):
    """Latent cache write, absorbed decode and non-absorbed prefill of one MLA layer.

    Options the kernels do not have (sliding window, KV cache kinds the provider does
    not take, logits soft cap, ALiBi, encoder attention, sparse MLA) are refused when
    vLLM builds the layer. An fp8 latent cache (``fp8`` / ``fp8_e4m3``) is written and
    read with the layer's ``_k_scale`` (a checkpoint's, else vLLM's 1.0).
    """

    # vLLM's DCP flags (AttentionImplBase): forward_mqa returns the LSE, so vLLM may
    # shard the latent cache over its DCP group (mla_context_parallel.py).
    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True
    # vLLM's PCP flag: each chunk of a rank's prefill is a request of the rank's batch,
    # and the rows vLLM gathers from every rank are written by the step's write_plan.
    supports_pcp: bool = True

    def __init__(self, **layer_args: Any) -> None:
        """vLLM's ``MLAAttention`` passes the impl's arguments by keyword: those of
        ``MLACommonImpl`` (its options are refused here when the kernels lack them)."""
        refuse_layer_options(
            alibi_slopes=layer_args.get("alibi_slopes"),
            kv_cache_dtype=layer_args.get("kv_cache_dtype", "auto"),
            attn_type=layer_args.get("attn_type", AttentionType.DECODER),
            sliding_window=layer_args.get("sliding_window"),
            logits_soft_cap=layer_args.get("logits_soft_cap"),
            extra={"indexer": layer_args.get("indexer")},
            mla=True,
        )
        super().__init__(**{k: v for k, v in layer_args.items() if k in _BASE_PARAMETERS})
        # The decode kernels take queries in the model dtype (no fp8 query input).
        self.supports_quant_query_input = False
        self.kv_cache_split = current_settings().kv_cache_split
        self.kv_cache_dtype = layer_args.get("kv_cache_dtype", "auto")
        self._layer_name: str | None = None

    # -- vLLM's MLA impl interface -------------------------------------------------

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        """Write the step's latents at the plan's slots (the same slots vLLM passes; under
        PCP the rows of every rank, at the group's gathered slots); an fp8 cache's rows
        quantized with ``k_scale`` (the layer's). ``skip_scale`` (vLLM 0.33 passes it,
        0.32 does not) is not taken: the scale is always applied."""
        if kv_cache.numel() == 0:
            return
        layer_name = self.layer_name()
        attn_metadata = layer_attn_metadata(layer_name)
        if attn_metadata is None:  # vLLM's profiling run
            return
        kv_c, k_pe = kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)
        if attn_metadata.plan.provider.contiguous_inputs:  # copies outside the task
            kv_c, k_pe = contiguous_rows(kv_c, k_pe)
        run_mla_write_cache(
            kv_c,
            k_pe,
            self.latent_cache(kv_cache, attn_metadata.plan.spec),
            attn_metadata,
            layer_name=layer_name,
            k_scale=self._cache_scale(k_scale),
        )

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: BridgeMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed attention of the decode rows: ``(q @ W_UK, q_pe)`` ->
        ``[B, N, kv_lora_rank]`` (rows of graph padding stay zero). Under DCP the
        query holds the group's ``size * N`` heads and the output comes with its
        float32 ``[B, size * N]`` LSE over this rank's latents."""
        if isinstance(q, tuple):
            q_latent, q_rope = q
        else:
            q_latent, q_rope = q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        plan = attn_metadata.plan
        rows, heads = q_latent.shape[0], plan.spec.num_heads
        lse = None
        if self.dcp_world_size > 1:
            lse = torch.full((rows, heads), float("-inf"), device=q_latent.device)
        if plan.provider.contiguous_inputs:  # vLLM's q_latent is a transposed bmm output
            q_latent, q_rope = contiguous_rows(q_latent, q_rope)
        padded = plan.provider.decode_heads(plan.spec, with_lse=lse is not None)
        if padded != heads:  # copied here, before the task: the kernel reads whole rows
            q_latent, q_rope = (head_prefix(x, padded) for x in (q_latent, q_rope))
        out = head_prefix(q_latent.new_zeros(rows, heads, self.kv_lora_rank), padded)
        run_mla_decode(
            q_latent,
            q_rope,
            self.latent_cache(kv_c_and_k_pe_cache, plan.spec),
            out,
            lse,
            attn_metadata,
            layer_name=self.layer_name(getattr(layer, "layer_name", None)),
            k_scale=self._cache_scale(getattr(layer, "_k_scale", None)),
        )
        return out.contiguous(), lse

    def forward_mha(  # type: ignore[override]
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: BridgeMLAMetadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """Non-absorbed causal attention of the prefill rows over keys and values
        decompressed from the cache by ``kv_b_proj``; writes ``output``
        ``[rows, N * v_head_dim]``."""
        if output_scale is not None:
            raise NotImplementedError(f"{PREFIX} does not fuse output quantization")
        run_mla_prefill(
            q,
            self.latent_cache(kv_c_and_k_pe_cache, attn_metadata.plan.spec),
            self._kv_up_proj,
            output.view(output.shape[0], self.num_heads, self.v_head_dim),
            attn_metadata,
            layer_name=self.layer_name(),
            k_scale=self._cache_scale(k_scale),
        )

    # -- helpers -------------------------------------------------------------------

    def _kv_up_proj(self, kv_c: torch.Tensor) -> torch.Tensor:
        return self.kv_b_proj(kv_c)[0]

    def _cache_scale(self, k_scale: torch.Tensor | None) -> torch.Tensor | None:
        """The scale npu-attention takes: the layer's for an fp8 cache, none for ``auto``."""
        return None if self.kv_cache_dtype == "auto" else k_scale

    def latent_cache(self, kv_cache: torch.Tensor, spec) -> LatentCache:
        """The layer's ``[num_blocks, block_size, latent_dim]`` cache as npu-attention's
        ``LatentCache``: views of vLLM's interleaved rows (``packed``), or two
        contiguous planes of the same region (``planes``, what Ascend's ops read). An
        fp8 cache (vLLM allocates ``uint8``) is viewed as ``float8_e4m3fn``."""
        if kv_cache.dim() == 4:  # [num_blocks, 1, block_size, latent_dim]
            kv_cache = kv_cache.squeeze(1)
        if kv_cache.dtype == torch.uint8 and spec.cache_dtype == torch.float8_e4m3fn:
            kv_cache = kv_cache.view(torch.float8_e4m3fn)
        if self.kv_cache_split == "planes":
            return latent_cache_planes(kv_cache, spec)
        return split_latent_cache(kv_cache, spec)

    def layer_name(self, known: str | None = None) -> str:
        """The name of the ``MLAAttention`` layer that owns this impl (vLLM builds the
        impl before it names the layer, so it is looked up once in the forward context)."""
        if self._layer_name is None:
            if known is not None:
                self._layer_name = known
            else:
                self._layer_name = _owner_layer_name(self)
        return self._layer_name


def head_prefix(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x`` ``[rows, N, D]`` as the first ``N`` heads of a zeroed contiguous ``[rows,
    heads, D]`` (``x`` itself when ``heads == N``): the layout in which a provider whose
    ``decode_heads`` exceeds ``N`` reads and writes whole rows in place."""
    if x.shape[1] == heads:
        return x
    padded = x.new_zeros(x.shape[0], heads, x.shape[2])
    padded[:, : x.shape[1]] = x
    return padded[:, : x.shape[1]]


def layer_attn_metadata(layer_name: str) -> BridgeMLAMetadata | None:
    """This layer's metadata in vLLM's forward context (``None`` in the profiling run)."""
    from vllm.forward_context import get_forward_context

    per_layer = get_forward_context().attn_metadata
    if isinstance(per_layer, list):  # speculative decoding: [0] is the model's own
        per_layer = per_layer[0] if per_layer else None
    return per_layer.get(layer_name) if isinstance(per_layer, dict) else None


def _owner_layer_name(impl: BridgeMLAImpl) -> str:
    from vllm.forward_context import get_forward_context

    for name, layer in get_forward_context().no_compile_layers.items():
        if getattr(layer, "impl", None) is impl:
            return name
    raise ValueError("this MLA impl belongs to no layer of vLLM's forward context")


def install_mla_dcp(vllm_config: Any) -> int:
    """Give every MLA layer of the bridge's backend a :class:`BridgeMLADCP` in place of
    vLLM's DCP manager; returns the number of layers changed (0 without DCP)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.distributed.parallel_state import get_dcp_group
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    changed = 0
    for layer in get_layers_from_vllm_config(vllm_config, MLAAttention).values():
        if getattr(layer, "dcp_manager", None) is None or not isinstance(layer.impl, BridgeMLAImpl):
            continue
        set_mla_dcp_manager(layer, BridgeMLADCP(get_dcp_group()))
        changed += 1
    return changed
