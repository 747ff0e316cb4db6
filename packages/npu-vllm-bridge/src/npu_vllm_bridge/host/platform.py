"""Host mode: vLLM's CPU platform with the bridge's attention and graph wiring.

Selected with ``NPU_BRIDGE_DEVICE=cpu``. It runs the same attention backend
(npu-attention's ``reference`` kernels) and the same graph capture, dispatch,
task update and replay as the NPU platform, with npu-graphs' ``host`` backend,
so both can be developed and tested without an NPU.

Graph modes: FULL_DECODE_ONLY, PIECEWISE and FULL_AND_PIECEWISE. A host graph is a
recording of aten ops, so it cannot see the inductor C++ kernels of vLLM's CPU
compile path: with piecewise graphs host mode keeps vLLM's compile path (Dynamo,
split at attention) with the ``eager`` backend, and otherwise turns compilation off.

The model runner is vLLM's choice (``VllmConfig.use_v2_model_runner``). Without
``VLLM_USE_V2_MODEL_RUNNER`` vLLM takes Model Runner V2 only where Triton has a backend,
and Triton has none on a CPU, so host mode runs the V1 runner; with
``VLLM_USE_V2_MODEL_RUNNER=1``, Model Runner V2 under Triton's interpreter, set up when
vLLM loads this module (``host/triton_interpreter.py``).

Micro-batch overlap (``--enable-dbo``) runs on data-parallel MoE models, on either
runner (vLLM runs it on V2 only with ``VLLM_USE_V2_MODEL_RUNNER=1``): the request is
held past ``CpuPlatform``'s switch-off and vLLM's all-to-all check, and restored in the
worker (``graphs/ubatch_config.py``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from npu_vllm_bridge.graphs.ubatch_config import hold_micro_batching
from npu_vllm_bridge.host import compiled_ops, custom_ops, triton_interpreter
from npu_vllm_bridge.platforms import checks
from npu_vllm_bridge.platforms.common import BridgePlatformMixin
from npu_vllm_bridge.settings import PREFIX, BridgeSettings
from npu_vllm_bridge.vllm_version import require_supported_vllm

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")

HOST_WORKER = "npu_vllm_bridge.host.worker.HostWorker"
HOST_COMMUNICATOR = "npu_vllm_bridge.host.communicator.HostCommunicator"
OMP_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"

require_supported_vllm()
# Before vLLM checks for Triton: V2, when asked for, runs under Triton's interpreter.
triton_interpreter.interpret_triton_for_v2()
# On a vLLM built without its compiled ops (the empty build): PyTorch versions of those
# its CPU worker and sampler call.
compiled_ops.register_missing()


class HostPlatform(BridgePlatformMixin, CpuPlatform):
    """vLLM's ``CpuPlatform`` whose attention backend and graphs are the bridge's."""

    # Host graphs record attention tasks whole and re-run them with each step's plan:
    # no workspace is sized at capture, so captures plan vLLM's short dummy contexts.
    bridge_settings = BridgeSettings(
        attention_provider="reference",
        kv_cache_split="packed",
        graph_backend="host",
        capture_longest_context=False,
        capture_on_first_use=True,
    )

    @classmethod
    def apply_config_platform_defaults(cls, vllm_config: VllmConfig) -> None:
        super().apply_config_platform_defaults(vllm_config)
        custom_ops.note_user_choice(vllm_config.compilation_config)

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CUDAGraphMode

        custom_ops_defaulted = custom_ops.take_defaulted(vllm_config.compilation_config)
        checks.check_model_and_options(vllm_config)
        refuse_expert_parallel(vllm_config.parallel_config)
        hold_micro_batching(vllm_config)  # before CpuPlatform turns DBO off
        compilation = vllm_config.compilation_config
        capture_sizes = list(compilation.cudagraph_capture_sizes or [])
        requested_mode = compilation.mode
        mla_settings = _mla_scheduling(vllm_config)
        super().check_and_update_config(vllm_config)  # empties the capture sizes
        _restore_mla_scheduling(vllm_config, mla_settings)
        mla_rotary_in_pytorch(vllm_config)
        _avoid_missing_compiled_ops(vllm_config)
        triton_interpreter.no_jit_warmup_when_interpreting(vllm_config)
        if compilation.cudagraph_mode != CUDAGraphMode.NONE:
            compilation.cudagraph_capture_sizes = capture_sizes
            _host_graph_compilation(compilation, requested_mode)
            if custom_ops_defaulted:
                _eager_custom_ops(compilation)
            checks.apply_capture_plan(vllm_config, cls.bridge_settings.graph_backend)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls in ("auto", "vllm.v1.worker.cpu_worker.CPUWorker"):
            parallel.worker_cls = HOST_WORKER
        _default_omp_threads_bind(ranks_on_this_node(parallel))

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        """vLLM's CPU communicator with the collectives data-parallel MoE needs."""
        return HOST_COMMUNICATOR

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """vLLM's CPU replacements of its Triton kernels, with a slot mapping that
        serves decode context parallelism (vLLM's CPU one refuses it); under Triton's
        interpreter (Model Runner V2), PyTorch versions of a decode step's kernels."""
        super().register_triton_kernel_overrides()
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:  # else vLLM's Triton kernel runs as it is
            from npu_vllm_bridge.host import slot_mapping

            slot_mapping.register()
        elif triton_interpreter.interpreting():
            from npu_vllm_bridge.host import v2_kernels

            v2_kernels.register()

    @classmethod
    def device_id_to_physical_device_id(cls, device_id: int) -> int:
        """vLLM's mapping of a local device id to a NUMA memory node, onto the nodes this
        process may use: vLLM 0.33 gives data-parallel rank ``r`` node ``r`` and binds its
        CPU worker's memory there, which a host with fewer nodes lacks; ranks beyond them
        share the nodes round robin (vLLM 0.32's CPU worker ignores the mapping)."""
        try:
            node = super().device_id_to_physical_device_id(device_id)
        except IndexError:  # CPU_VISIBLE_MEMORY_NODES lists fewer nodes than ranks
            node = device_id
        return shared_memory_node(int(node))

    @classmethod
    def graph_pool_handle(cls) -> object:
        """A new npu-graphs host graph pool (vLLM's V2 graph managers ask for one)."""
        from npu_graphs import get_backend

        return get_backend(cls.bridge_settings.graph_backend).new_pool()


def shared_memory_node(node: int) -> int:
    """``node`` when this process may use it, else a usable node, round robin."""
    from vllm.utils.cpu_resource_utils import get_memory_affinity

    allowed = sorted(get_memory_affinity())
    if not allowed or node in allowed:
        return node
    return allowed[node % len(allowed)]


def refuse_expert_parallel(parallel) -> None:
    """Raise ``ValueError`` for expert parallelism: vLLM's CPU MoE kernel ignores the
    expert map and crashes under it (data-parallel MoE runs without it)."""
    if getattr(parallel, "enable_expert_parallel", False):
        raise ValueError(
            f"{PREFIX} host mode does not run expert parallelism (enable_expert_parallel="
            "True): vLLM's CPU MoE kernel ignores the expert map; leave it off (data "
            "parallel MoE runs without it)"
        )


def _mla_scheduling(vllm_config: VllmConfig) -> list[tuple[object, str, object]]:
    """The chunked-prefill, prefix-caching, token-budget and block-size settings of an
    MLA model, which ``CpuPlatform`` overrides for its own MLA kernels (no chunked
    prefill or prefix caching, block size 16); the bridge's MLA runs all of them."""
    model_config = vllm_config.model_config
    if model_config is None or not model_config.use_mla:
        return []
    scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
    names = [
        (scheduler, "enable_chunked_prefill"),
        (scheduler, "max_num_batched_tokens"),
        (cache, "enable_prefix_caching"),
    ]
    if cache.user_specified_block_size:
        names.append((cache, "block_size"))
    return [(config, name, getattr(config, name)) for config, name in names]


def _restore_mla_scheduling(
    vllm_config: VllmConfig, settings: list[tuple[object, str, object]]
) -> None:
    """Undo ``CpuPlatform``'s MLA overrides (see :func:`_mla_scheduling`)."""
    if not settings:
        return
    for config, name, value in settings:
        setattr(config, name, value)
    logger.info(
        f"{PREFIX} host mode: MLA with chunked prefill %s and prefix caching %s",
        "on" if vllm_config.scheduler_config.enable_chunked_prefill else "off",
        "on" if vllm_config.cache_config.enable_prefix_caching else "off",
    )


ROTARY_OP = "rotary_embedding"


def mla_rotary_in_pytorch(vllm_config: VllmConfig) -> None:
    """Rotate an MLA model's queries and keys with vLLM's PyTorch rotary embedding.

    vLLM's CPU rotary-embedding kernel (``torch.ops._C.rotary_embedding``, used by
    ``RotaryEmbedding.forward_cpu`` when custom ops are on, as in eager mode) rotates a
    3-D query ``[tokens, heads, rope_dim]``, the way vLLM's MLA layers pass ``q_pe``,
    wrongly, and one token's result depends on how many tokens the batch holds: greedy
    tokens of an MLA model then change with the batch and leave transformers'. A user's
    explicit ``+rotary_embedding`` is kept."""
    model_config = vllm_config.model_config
    if model_config is None or not model_config.use_mla:
        return
    custom_ops = vllm_config.compilation_config.custom_ops
    if f"+{ROTARY_OP}" in custom_ops or f"-{ROTARY_OP}" in custom_ops:
        return
    custom_ops.append(f"-{ROTARY_OP}")
    logger.info(
        f"{PREFIX} host mode: MLA rotary embedding in PyTorch (vLLM's CPU rotary kernel "
        "rotates MLA's 3-D queries wrongly)"
    )


def _avoid_missing_compiled_ops(vllm_config: VllmConfig) -> None:
    """On a vLLM without ``vllm._C``, vLLM's PyTorch paths of custom ops whose CPU path
    calls a compiled op (``compiled_ops.avoid_missing_custom_ops``)."""
    added = compiled_ops.avoid_missing_custom_ops(vllm_config.compilation_config.custom_ops)
    if added:
        logger.info(
            f"{PREFIX} host mode: %s (this vLLM build has no compiled CPU ops)", ", ".join(added)
        )


def omp_threads_bind(cpus: list[int], ranks: int) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``ranks`` workers its own
    contiguous share of ``cpus`` (ranks separated by ``|``, e.g. ``"0|1"`` or
    ``"0-3|4-7"``); with fewer CPUs than ranks, ranks share CPUs round robin."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if not cpus:
        raise ValueError("cpus is empty: no CPU to bind worker threads to")
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        return "|".join(str(cpus[rank % len(cpus)]) for rank in range(ranks))
    share, extra = divmod(len(cpus), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        end = start + share + (rank < extra)
        groups.append(",".join(str(cpu) for cpu in cpus[start:end]))
        start = end
    return "|".join(groups)


def ranks_on_this_node(parallel) -> int:
    """The CPU workers this node starts, one binding entry each: its share of a
    data-parallel replica's TP x PP x PCP ranks (vLLM's ``local_world_size``, the
    replica's ranks over the nodes it spans) times the replicas it hosts
    (``data_parallel_size_local``). vLLM 0.32 and 0.33 give a worker the entries
    ``[local DP rank x local_world_size, + local_world_size)`` of the list, so a list
    sized by the ranks of every node would put each node's workers on the first
    node's share.

    vLLM's offline data parallelism (``VLLM_DP_*`` variables, one process per DP rank,
    ``data_parallel_rank_local`` set from them) does not say how many DP ranks share
    the node: there the list covers every DP rank, exact on one node."""
    replicas = parallel.data_parallel_size_local
    if parallel.data_parallel_rank_local is not None:
        replicas = parallel.data_parallel_size
    return parallel.local_world_size * replicas


def _default_omp_threads_bind(ranks: int) -> None:
    """Bind each CPU worker's OpenMP threads to its own cores when the user has not
    chosen (``VLLM_CPU_OMP_THREADS_BIND`` unset) and vLLM's ``auto`` binding, one NUMA
    node per rank, cannot apply. Set in this process's environment, which the engine
    core and its worker processes inherit; vLLM reads it when it starts the workers."""
    if ranks <= 1 or OMP_THREADS_BIND in os.environ:
        return
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(get_visible_memory_node()) >= ranks:
        return
    os.environ[OMP_THREADS_BIND] = omp_threads_bind(sorted(os.sched_getaffinity(0)), ranks)
    logger.info(
        f"{PREFIX} host mode: %s=%s (%d ranks, fewer NUMA nodes than ranks)",
        OMP_THREADS_BIND,
        os.environ[OMP_THREADS_BIND],
        ranks,
    )


def _host_graph_compilation(compilation, requested_mode) -> None:
    """Compile settings a host graph can record: vLLM's piecewise split with the
    ``eager`` backend (the pieces stay aten ops), or no compilation at all."""
    from vllm.config import CompilationMode

    if compilation.cudagraph_mode.has_piecewise_cudagraphs() and (
        requested_mode == CompilationMode.VLLM_COMPILE
    ):
        compilation.mode = CompilationMode.VLLM_COMPILE
        compilation.backend = "eager"
        return
    if compilation.mode != CompilationMode.NONE:
        logger.info(
            f"{PREFIX} host mode: torch.compile off (host graphs record aten ops, "
            "not inductor kernels)"
        )
        compilation.mode = CompilationMode.NONE


def _eager_custom_ops(compilation) -> None:
    """vLLM's custom-op default for the compile settings host graphs run with: the
    kernels eager steps run (``custom_ops.py``)."""
    changed = custom_ops.redo_vllm_default(compilation)
    if changed is not None:
        logger.info(
            f"{PREFIX} host mode: custom_ops %r, as eager steps (vLLM chose its default "
            "for inductor, which host graphs turn off)",
            changed,
        )
