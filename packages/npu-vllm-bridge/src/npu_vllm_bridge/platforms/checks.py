"""Start-up checks shared by both platforms: refuse what the bridge cannot run.

Every check raises ``ValueError`` naming the model property or option and what
to change, from ``check_and_update_config`` (i.e. while vLLM builds its config),
before weights load or memory is reserved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import npu_attention
from npu_attention.mla import MLASpec
from npu_graphs import get_backend, plan_capture
from npu_vllm_bridge.attention.capabilities import KERNEL_BLOCK_SIZES, refuse_head_size
from npu_vllm_bridge.platforms.context_parallel_checks import check_context_parallel
from npu_vllm_bridge.platforms.speculative import check_quantized_verify, check_speculative
from npu_vllm_bridge.settings import PREFIX, current_provider, refuse_kv_cache_dtype

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The block size the MLA start-up check plans with when the user chose none; the
# provider's block sizes are checked again with the real one when the layers plan.
DEFAULT_CHECK_BLOCK_SIZE = 16


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
    refuse_head_size(model_config.get_head_size(), f"model {name}")
    if model_config.dtype not in npu_attention.SUPPORTED_DTYPES:
        raise ValueError(
            f"{PREFIX} does not support dtype {model_config.dtype}; use one of "
            f"{[str(d) for d in npu_attention.SUPPORTED_DTYPES]}"
        )


def _check_cache(vllm_config: VllmConfig) -> None:
    cache_config = vllm_config.cache_config
    model_config = vllm_config.model_config
    mla = model_config is not None and model_config.use_mla
    refuse_kv_cache_dtype(cache_config.cache_dtype, "mla" if mla else "attention")
    block_size = cache_config.block_size
    if cache_config.user_specified_block_size and block_size % min(KERNEL_BLOCK_SIZES):
        raise ValueError(
            f"{PREFIX} needs a KV-cache block_size that is a multiple of {min(KERNEL_BLOCK_SIZES)}, got "
            f"block_size={block_size}"
        )


def _check_parallel_and_speculative(vllm_config: VllmConfig) -> None:
    check_context_parallel(vllm_config)
    check_speculative(vllm_config)
    check_quantized_verify(vllm_config)
    if vllm_config.kv_transfer_config is not None:
        raise ValueError(f"{PREFIX} does not support KV transfer connectors (kv_transfer_config)")


def check_mla_model(model_config: Any, block_size: int | None = None) -> None:
    """Refuse an MLA model the bridge cannot run (``ValueError`` naming it).

    Args:
        model_config: vLLM's ``ModelConfig`` of a model with ``use_mla``.
        block_size: the KV-cache block size if the user chose one.

    Raises:
        ValueError: sparse MLA (``index_topk``), or an MLA shape the platform's MLA
            provider refuses (message: provider, widths, heads, block size, dtype).
    """
    name = model_config.model
    text_config = model_config.hf_text_config
    if getattr(text_config, "index_topk", None) is not None:
        raise ValueError(
            f"{PREFIX} does not support sparse MLA (index_topk={text_config.index_topk}, "
            f"DeepSeek-V3.2's indexer); {name} uses it"
        )
    widths = {
        field: getattr(text_config, attribute, None)
        for field, attribute in (
            ("num_heads", "num_attention_heads"),
            ("kv_lora_rank", "kv_lora_rank"),
            ("qk_nope_head_dim", "qk_nope_head_dim"),
            ("qk_rope_head_dim", "qk_rope_head_dim"),
            ("v_head_dim", "v_head_dim"),
        )
    }
    block_size = block_size or DEFAULT_CHECK_BLOCK_SIZE
    provider = current_provider("mla")
    sizes = ", ".join(f"{key}={value}" for key, value in widths.items())
    try:
        spec = MLASpec(**widths, block_size=block_size, dtype=model_config.dtype)
        npu_attention.get_provider(provider, family="mla").check_spec(spec)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{PREFIX} cannot run the MLA layers of {name} with the {provider!r} MLA "
            f"provider ({sizes}, block_size={block_size}, dtype={model_config.dtype}): "
            f"{error}"
        ) from None


def apply_capture_plan(vllm_config: VllmConfig, backend_name: str) -> None:
    """Set vLLM's capture sizes from npu-graphs' capture planner.

    The planner keeps the sizes vLLM chose that a step can reach and that fit the
    graph backend's budget (the NPU's stream budget: about L + 1 streams per graph
    of an L-layer model); dropped sizes run padded to a larger graph or eagerly.

    Raises:
        ValueError: a capture size larger than a step can be, or a budget that
            leaves no graph at all, with what to change.
    """
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
