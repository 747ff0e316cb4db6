"""Start-up checks shared by both platforms: refuse what the bridge cannot run.

Every check raises ``ValueError`` naming the model property or option and what
to change, from ``check_and_update_config`` (i.e. while vLLM builds its config),
before weights load or memory is reserved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import npu_attention

# The platform module is imported while vLLM resolves ``current_platform``, so
# nothing here may import vLLM modules that need it at import time: the
# attention backend is imported inside the functions.
KERNEL_BLOCK_SIZES = (16, 32, 64, 128)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.selector import AttentionSelectorConfig

PREFIX = "npu-vllm-bridge"


def check_model_and_options(vllm_config: VllmConfig) -> None:
    """Refuse models and options the bridge's attention cannot serve."""
    model_config = vllm_config.model_config
    if model_config is not None:
        _check_model(model_config)
    _check_cache(vllm_config)
    _check_parallel_and_speculative(vllm_config)


def _check_model(model_config) -> None:
    name = model_config.model
    if model_config.use_mla:
        from npu_vllm_bridge.platforms.mla_checks import check_mla_model

        check_mla_model(model_config)
        return
    # "draft": a draft model, whose own VllmConfig vLLM checks when it loads the drafter.
    if model_config.runner_type not in ("generate", "draft"):
        raise ValueError(
            f"{PREFIX} runs generative decoder models only; {name} is a "
            f"{model_config.runner_type!r} model"
        )
    if model_config.is_encoder_decoder:
        raise ValueError(f"{PREFIX} does not support encoder-decoder models such as {name}")
    head_size = model_config.get_head_size()
    provider, head_sizes = attention_head_sizes()
    if head_size not in head_sizes:
        raise ValueError(
            f"{PREFIX} does not support head size {head_size} (model {name}) with the "
            f"{provider!r} attention provider; supported head sizes: {list(head_sizes)}"
        )
    if model_config.dtype not in npu_attention.SUPPORTED_DTYPES:
        raise ValueError(
            f"{PREFIX} does not support dtype {model_config.dtype}; use one of "
            f"{[str(d) for d in npu_attention.SUPPORTED_DTYPES]}"
        )


def attention_head_sizes() -> tuple[str, tuple[int, ...]]:
    """The npu-attention provider the current platform will use (its
    ``attention_provider``, or ``None`` to choose by the platform's device type),
    and the head sizes that provider accepts."""
    from vllm.platforms import current_platform

    name = getattr(current_platform, "attention_provider", None)
    if name is not None:
        return name, npu_attention.supported_head_sizes(name)
    device_type = current_platform.device_type
    provider = npu_attention.get_provider(device=device_type)
    return provider.name, npu_attention.supported_head_sizes(provider.name)


def _check_cache(vllm_config: VllmConfig) -> None:
    cache_config = vllm_config.cache_config
    if cache_config.cache_dtype != "auto":
        raise ValueError(
            f"{PREFIX} keeps the KV cache in the model dtype; kv_cache_dtype="
            f"{cache_config.cache_dtype!r} (e.g. an fp8 KV cache) is not supported: "
            "leave kv_cache_dtype='auto'"
        )
    block_size = cache_config.block_size
    if cache_config.user_specified_block_size and not any(
        block_size % size == 0 for size in KERNEL_BLOCK_SIZES
    ):
        raise ValueError(
            f"{PREFIX} needs a KV-cache block_size that is a multiple of 16, got "
            f"block_size={block_size}"
        )


def _check_parallel_and_speculative(vllm_config: VllmConfig) -> None:
    from npu_vllm_bridge.platforms.context_parallel_checks import check_context_parallel
    from npu_vllm_bridge.platforms.speculative import check_speculative

    check_context_parallel(vllm_config)
    check_speculative(vllm_config)
    if vllm_config.kv_transfer_config is not None:
        raise ValueError(f"{PREFIX} does not support KV transfer connectors (kv_transfer_config)")


def backend_for_selector(selector: AttentionSelectorConfig) -> str:
    """The bridge's backend class path, or ``ValueError`` saying why it cannot serve
    a layer vLLM asks for (MLA, sparse attention, sinks, a head size, ...)."""
    from npu_vllm_bridge.attention.backend import NPUBridgeAttentionBackend, register

    backend = NPUBridgeAttentionBackend
    if selector.use_mla:
        from npu_vllm_bridge.platforms.mla_checks import mla_backend_for_selector

        return mla_backend_for_selector(selector)
    if selector.use_sparse:
        raise ValueError(f"{PREFIX} does not support sparse attention layers")
    reasons = backend.validate_configuration(
        head_size=selector.head_size,
        dtype=selector.dtype,
        kv_cache_dtype=selector.kv_cache_dtype,
        block_size=selector.block_size,
        use_mla=selector.use_mla,
        has_sink=selector.has_sink,
        use_sparse=selector.use_sparse,
        use_mm_prefix=selector.use_mm_prefix,
        use_per_head_quant_scales=selector.use_per_head_quant_scales,
        device_capability=None,
        attn_type=selector.attn_type,
        has_sliding_window=selector.has_sliding_window,
        use_non_causal=selector.use_non_causal,
        use_batch_invariant=selector.use_batch_invariant,
        use_kv_connector=selector.use_kv_connector,
        use_pcp=selector.use_pcp,
        use_adaptive_verification=selector.use_adaptive_verification,
        use_dcp=selector.use_dcp,
        use_rswa=selector.use_rswa,
    )
    if "head_size not supported" in reasons:
        provider, head_sizes = attention_head_sizes()
        reasons[reasons.index("head_size not supported")] = (
            f"head_size not supported by the {provider!r} attention provider "
            f"(its head sizes: {list(head_sizes)})"
        )
    if reasons:
        raise ValueError(
            f"{PREFIX} attention cannot serve this layer (head_size={selector.head_size}, "
            f"dtype={selector.dtype}, kv_cache_dtype={selector.kv_cache_dtype}, "
            f"block_size={selector.block_size}, attn_type={selector.attn_type}): "
            + "; ".join(reasons)
        )
    register()
    return f"{backend.__module__}.{backend.__qualname__}"


def apply_capture_plan(vllm_config: VllmConfig, backend_name: str) -> None:
    """Set vLLM's capture sizes from npu-graphs' capture planner.

    The planner keeps the sizes vLLM chose that a step can reach and that fit the
    graph backend's budget (the NPU's stream budget: about L + 1 streams per graph
    of an L-layer model); dropped sizes run padded to a larger graph or eagerly.

    Raises:
        ValueError: a capture size larger than a step can be, or a budget that
            leaves no graph at all, with what to change.
    """
    from npu_graphs import get_backend, plan_capture

    compilation = vllm_config.compilation_config
    sizes = sorted(compilation.cudagraph_capture_sizes or [])
    if not sizes:
        return
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if sizes[-1] > max_tokens:
        raise ValueError(
            f"{PREFIX}: capture size {sizes[-1]} exceeds max_num_batched_tokens={max_tokens}; "
            "lower cudagraph_capture_sizes or raise max_num_batched_tokens"
        )
    budget = None
    if vllm_config.model_config is not None:
        num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        budget = get_backend(backend_name).max_graphs(num_layers)
        if budget is not None and budget < 1:
            raise ValueError(
                f"{PREFIX}: a {num_layers}-layer model leaves no room for a single "
                f"{backend_name} graph; run with enforce_eager=True"
            )
    plan = plan_capture(
        sizes,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        max_graphs=budget,
    )
    compilation.cudagraph_capture_sizes = list(plan.sizes)
    compilation.max_cudagraph_capture_size = plan.max_size
