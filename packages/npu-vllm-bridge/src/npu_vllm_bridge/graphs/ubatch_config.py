"""Turning micro-batch overlap on as on CUDA: ``--enable-dbo`` (or ``--ubatch-size``).

Two checks of vLLM 0.32 stand in the way outside CUDA: ``CpuPlatform`` switches DBO
off ("Dual-Batch Overlap is not supported on CPU"), and ``VllmConfig`` asserts, after
the platform's ``check_and_update_config``, that DBO runs over a DeepEP or NIXL
all-to-all backend (their kernels yield between micro-batches; the bridge's
micro-batches hand over at its own collectives instead, ``ubatch_wrapper.py``).

So the platform *holds* the request while vLLM checks its config: it refuses what the
bridge's micro-batching does not run, records the user's ``enable_dbo`` and
``ubatch_size`` in ``additional_config`` (which travels with the config to the engine
core and its workers) and switches them off; the worker *restores* them before it
builds the model runner, whose step planning (vLLM's thresholds, the split agreed
across data-parallel ranks, one attention-metadata builder per micro-batch) then runs
as on CUDA. The thresholds (``dbo_decode_token_threshold``,
``dbo_prefill_token_threshold``) are left as given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger

from npu_vllm_bridge.settings import PREFIX
from npu_vllm_bridge.vllm_seam import dbo_unsupported_features

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")

HELD_KEY = "npu_bridge_micro_batching"


def hold_micro_batching(vllm_config: VllmConfig) -> bool:
    """In the platform's ``check_and_update_config``, before vLLM's own checks: keep a
    micro-batching request out of vLLM's sight until the worker restores it.

    Returns:
        Whether micro-batching was requested (and is now held).

    Raises:
        ValueError: micro-batching with an option the bridge does not run it with.
    """
    parallel = vllm_config.parallel_config
    if not parallel.use_ubatching:
        return False
    refuse_micro_batching_options(vllm_config)
    additional = vllm_config.additional_config
    if not isinstance(additional, dict):
        raise ValueError(
            f"{PREFIX} keeps the micro-batching request in additional_config, which must "
            f"then be a dict, got {type(additional).__name__}"
        )
    additional[HELD_KEY] = {"enable_dbo": parallel.enable_dbo, "ubatch_size": parallel.ubatch_size}
    parallel.enable_dbo, parallel.ubatch_size = False, 0
    if parallel.data_parallel_size == 1:
        logger.warning(
            f"{PREFIX}: micro-batch overlap is on, but vLLM splits steps only across "
            "data-parallel ranks of a MoE model (data_parallel_size=1 here): no step will split"
        )
    logger.info(
        f"{PREFIX}: micro-batch overlap (%s) runs on the bridge's micro-batch runner; "
        "split thresholds: %d decode tokens, %d tokens with a prefill",
        "enable_dbo" if additional[HELD_KEY]["enable_dbo"] else "ubatch_size",
        parallel.dbo_decode_token_threshold,
        parallel.dbo_prefill_token_threshold,
    )
    return True


def restore_micro_batching(vllm_config: VllmConfig) -> bool:
    """In the worker, before the model runner is built: switch held micro-batching back
    on. Returns whether there was any (calling it again changes nothing)."""
    additional = vllm_config.additional_config
    held = additional.get(HELD_KEY) if isinstance(additional, dict) else None
    if not held:
        return False
    parallel = vllm_config.parallel_config
    parallel.enable_dbo, parallel.ubatch_size = held["enable_dbo"], held["ubatch_size"]
    return True


def refuse_micro_batching_options(vllm_config: VllmConfig) -> None:
    """Raise ``ValueError`` for what the bridge does not micro-batch.

    On Model Runner V2 (vLLM runs DBO there only with ``VLLM_USE_V2_MODEL_RUNNER=1``;
    otherwise it picks V1), what vLLM's V2 runner refuses
    (``VllmConfig._get_dbo_unsupported_features``: speculative decoding, LoRA, pipeline
    stages, context parallelism, multimodal, hybrid and encoder-only models, PIECEWISE
    graphs); vLLM's own check runs only while DBO is on, and the platform holds it off.
    On V1: pipeline stages, speculative decoding, context parallelism, multimodal
    models (their positions and embeddings split otherwise)."""
    if vllm_config.use_v2_model_runner:
        blockers = dbo_unsupported_features(vllm_config)
        runner = "Model Runner V2"
    else:
        blockers = _v1_blockers(vllm_config)
        runner = "Model Runner V1"
    if blockers:
        raise ValueError(
            f"{PREFIX} runs micro-batch overlap (enable_dbo / ubatch_size) on {runner} "
            f"without {', '.join(blockers)}; got them together: turn one or the other off"
        )


def _v1_blockers(vllm_config: VllmConfig) -> list[str]:
    parallel = vllm_config.parallel_config
    model_config = vllm_config.model_config
    blockers = []
    if parallel.pipeline_parallel_size > 1:
        blockers.append(f"pipeline_parallel_size={parallel.pipeline_parallel_size}")
    if vllm_config.speculative_config is not None:
        blockers.append("speculative decoding")
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        blockers.append("context parallelism")
    if model_config is not None and model_config.is_multimodal_model:
        blockers.append(f"the multimodal model {model_config.model}")
    return blockers
