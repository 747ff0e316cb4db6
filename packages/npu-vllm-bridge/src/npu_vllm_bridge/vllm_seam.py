"""The one place the bridge reaches into vLLM's internals.

Every private vLLM name the bridge reads, calls or overrides, every vLLM kernel or
compiled op it names by string, every class it swaps into a vLLM module and every
method or attribute it replaces on a vLLM object is an :class:`Internal` in
:data:`INTERNALS`; the rest of the bridge goes through the accessors below, which do
exactly what the call sites did. ``tests/test_vllm_seam.py`` checks each entry
against the installed vLLM (it resolves, callables take the parameters listed).
Public vLLM API is imported where it is used, not here.

A vLLM upgrade: run that test, then read the entries it names.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

# The vLLM versions every entry was checked against.
CHECKED_AGAINST = ("0.32.0", "0.33.0")

FUNCTION = "function"
METHOD = "method"
CLASS = "class"
CLASS_ATTRIBUTE = "class attribute"
MODULE_ATTRIBUTE = "module attribute"
INSTANCE_ATTRIBUTE = "instance attribute"
TRITON_KERNEL = "triton kernel"
COMPILED_OP = "compiled op"
KINDS = (
    FUNCTION,
    METHOD,
    CLASS,
    CLASS_ATTRIBUTE,
    MODULE_ATTRIBUTE,
    INSTANCE_ATTRIBUTE,
    TRITON_KERNEL,
    COMPILED_OP,
)


@dataclass(frozen=True)
class Internal:
    """One vLLM internal the bridge relies on.

    ``module`` is the vLLM module defining it and ``qualname`` its dotted name there
    (``Class.attribute`` for members). ``params`` are the parameter names a callable
    is expected to take (``self`` included for methods; a class: its constructor's; a
    Triton kernel: its ``arg_names``; a compiled op: its schema's arguments), None
    for data; ``params_from`` is ``(version, params)`` where a later vLLM changed them.
    ``since`` is the first vLLM version that has it, where the bridge acts only when
    it exists. ``why`` says what the bridge does with it.
    """

    module: str
    qualname: str
    kind: str
    params: tuple[str, ...] | None
    why: str
    since: str | None = None
    params_from: tuple[str, tuple[str, ...]] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Internal kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def name(self) -> str:
        """The last component of ``qualname`` (the attribute name on its owner)."""
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def path(self) -> str:
        """``module.qualname``: the dotted path vLLM's kernel dispatcher keys on."""
        return f"{self.module}.{self.qualname}"

    def owner(self) -> Any:
        """The module (or class, or module-level object) holding ``name``."""
        if self.kind == COMPILED_OP:
            import torch

            importlib.import_module(self.module)
            return getattr(torch.ops, COMPILED_OPS_NAMESPACE)
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split(".")[:-1]:
            obj = getattr(obj, part)
        return obj

    def params_in(self, version: tuple[int, ...]) -> tuple[str, ...] | None:
        """The parameters expected in the vLLM release ``version`` (``(0, 33, 0)``)."""
        if self.params_from is not None and version >= _release(self.params_from[0]):
            return self.params_from[1]
        return self.params

    def resolve(self) -> Any:
        """The object itself (an instance attribute: its owner class)."""
        owner = self.owner()
        if self.kind == INSTANCE_ATTRIBUTE:
            return owner
        return getattr(owner, self.name)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _names(spaced: str) -> tuple[str, ...]:
    return tuple(spaced.split())


def _entry(module: str, qualname: str, kind: str, params: tuple[str, ...] | None, why: str,
           since: str | None = None) -> Internal:  # fmt: skip
    return Internal(module, qualname, kind, params, why, since)


# --- attention -----------------------------------------------------------------------

_ATTENTION = "vllm.model_executor.layers.attention.attention"
_ATTN_BACKEND = "vllm.v1.attention.backend"
ATTN_K_SCALE = _entry(
    _ATTENTION, "Attention._k_scale", INSTANCE_ATTRIBUTE, None,
    "the layer's per-tensor key scale of an 8-bit KV cache",
)  # fmt: skip
ATTN_V_SCALE = _entry(
    _ATTENTION, "Attention._v_scale", INSTANCE_ATTRIBUTE, None,
    "the layer's per-tensor value scale of an 8-bit KV cache",
)  # fmt: skip
BUILDER_CUDAGRAPH_SUPPORT = _entry(
    _ATTN_BACKEND, "AttentionMetadataBuilder._cudagraph_support", CLASS_ATTRIBUTE, None,
    "a builder's graph support without a drafter (get_cudagraph_support's answer)",
)  # fmt: skip
BUILDER_INIT_REORDER_BATCH_THRESHOLD = _entry(
    _ATTN_BACKEND, "AttentionMetadataBuilder._init_reorder_batch_threshold", METHOD,
    _names("self reorder_batch_threshold supports_spec_as_decode supports_dcp_with_varlen"),
    "verify requests of 1 + k query tokens count as decodes",
)  # fmt: skip
SELECTOR_ASDICT = _entry(
    "vllm.v1.attention.selector", "AttentionSelectorConfig._asdict", METHOD, _names("self"),
    "the selector's fields as validate_configuration's keyword arguments",
)  # fmt: skip
MLA_DCP_MANAGER = _entry(
    "vllm.model_executor.layers.attention.mla_attention", "MLAAttention.dcp_manager",
    INSTANCE_ATTRIBUTE, None,
    "an MLA layer's decode-context-parallel manager, replaced by the bridge's",
)  # fmt: skip

# --- forward context and micro-batching ----------------------------------------------

FORWARD_CONTEXT = _entry(
    "vllm.forward_context", "_forward_context", MODULE_ATTRIBUTE, None,
    "the current forward context, set per micro-batch thread at each turn",
)  # fmt: skip
DBO_CURRENT_UBATCH_ID = _entry(
    "vllm.v1.worker.ubatching", "dbo_current_ubatch_id", FUNCTION, (),
    "rebound in every vLLM module that imported it: the bridge's micro-batch index",
)  # fmt: skip
DBO_CURRENT_UBATCH_TOKEN_OFFSET = _entry(
    "vllm.v1.worker.ubatching", "dbo_current_ubatch_token_offset", FUNCTION, (),
    "rebound in every vLLM module that imported it: the bridge's micro-batch offset",
    since="0.33.0",
)  # fmt: skip
GPU_RUNNER_UBATCH_WRAPPER = _entry(
    "vllm.v1.worker.gpu_model_runner", "UBatchWrapper", CLASS,
    _names("runnable vllm_config runtime_mode device"),
    "swapped for a pass-through while vLLM's V1 runner loads the model",
)  # fmt: skip
V2_UBATCH_RUNNER = _entry(
    "vllm.v1.worker.gpu.ubatch_utils", "UBatchRunner", CLASS,
    _names("vllm_config device model_state attn_groups kv_cache_config max_num_reqs"),
    "swapped for the bridge's micro-batch runner while the V2 runner builds it",
)  # fmt: skip
DBO_UNSUPPORTED_FEATURES = _entry(
    "vllm.config.vllm", "VllmConfig._get_dbo_unsupported_features", METHOD, _names("self"),
    "what vLLM's V2 runner refuses to micro-batch, asked while the platform holds DBO",
)  # fmt: skip
V2_DISPATCH_CG_AND_SYNC_DP = Internal(
    "vllm.v1.worker.gpu.model_runner", "dispatch_cg_and_sync_dp", FUNCTION,
    _names(
        "cudagraph_manager num_reqs num_tokens uniform_token_count dp_size dp_rank "
        "max_query_len need_eager num_active_loras parallel_config allow_ubatching "
        "uniform_decode dp_sync_state"
    ),
    "swapped while the V2 runner executes a step: the graph manager captures a FULL "
    "descriptor at first use only once the DP ranks agreed on it",
    params_from=(
        "0.33.0",
        _names(
            "cudagraph_manager num_reqs num_tokens uniform_token_count dp_size dp_rank "
            "max_query_len need_eager num_active_loras parallel_config allow_ubatching "
            "uniform_decode allow_skip_drafts dp_sync_state"
        ),
    ),
)  # fmt: skip
DP_METADATA_MAKE = _entry(
    "vllm.forward_context", "DPMetadata.make", METHOD,
    _names("parallel_config num_tokens num_tokens_across_dp_cpu"),
    "host mode: run outside the host graph's recording in a V2 capture (it asserts on a "
    "tensor's value)",
)  # fmt: skip
# What vLLM's V2 UBatchRunner.__init__ builds for its CUDA threads (streams, barrier,
# SM control); the bridge's runner builds the rest (v2_ubatch_runner_buffers).
V2_UBATCH_RUNNER_CUDA_ATTRIBUTES = (
    "comm_stream", "capture_stream", "ready_barrier", "_pending_finish", "sm_control",
)  # fmt: skip

# --- Model Runner V1 -----------------------------------------------------------------

_V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V1_WARMUP_AND_CAPTURE = _entry(
    _V1_RUNNER, "GPUModelRunner._warmup_and_capture", METHOD,
    _names(
        "self desc cudagraph_runtime_mode profile_seq_lens allow_microbatching num_warmups "
        "profiler"
    ),
    "warm up and capture one batch descriptor (the bridge's capture loop)",
)  # fmt: skip
V1_INIT_MINIMAL_KV_CACHE_FOR_PROFILING = _entry(
    _V1_RUNNER, "GPUModelRunner._init_minimal_kv_cache_for_profiling", METHOD, _names("self"),
    "a small KV cache for the graph memory estimate before the real one",
)  # fmt: skip
V1_CLEANUP_PROFILING_KV_CACHE = _entry(
    _V1_RUNNER, "GPUModelRunner._cleanup_profiling_kv_cache", METHOD, _names("self"),
    "frees the estimate's KV cache",
)  # fmt: skip
COMPILATION_COUNTER_CUDAGRAPHS = _entry(
    "vllm.compilation.counter", "compilation_counter.num_cudagraph_captured",
    INSTANCE_ATTRIBUTE, None,
    "restored after the memory estimate's captures",
)  # fmt: skip

# --- Model Runner V2 -----------------------------------------------------------------

_V2_GRAPHS = "vllm.v1.worker.gpu.cudagraph_utils"
_GRAPH_MANAGER_PARAMS = _names(
    "vllm_config device cudagraph_mode decode_query_len lora_capture_cases varlen_decode "
    "ubatch_runner"
)  # fmt: skip
_V2_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.speculator"
V2_MODEL_GRAPH_MANAGER = _entry(
    "vllm.v1.worker.gpu.model_runner", "ModelCudaGraphManager", CLASS,
    _GRAPH_MANAGER_PARAMS,
    "swapped for the bridge's manager while the V2 runner builds it",
)  # fmt: skip
V2_TDAR_SPECULATOR_GRAPH_MANAGER = _entry(
    "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator",
    "SpeculatorCudaGraphManager", CLASS,
    _GRAPH_MANAGER_PARAMS,
    "swapped for the bridge's drafter manager (EAGLE, draft models)",
)  # fmt: skip
V2_MTP_SPECULATOR_GRAPH_MANAGER = _entry(
    "vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator",
    "SpeculatorCudaGraphManager", CLASS,
    _GRAPH_MANAGER_PARAMS,
    "swapped for the bridge's drafter manager (multi-module MTP)",
)  # fmt: skip
V2_CAPTURE_DESCS = _entry(
    _V2_GRAPHS, "CudaGraphManager._capture_descs", INSTANCE_ATTRIBUTE, None,
    "the descriptors the manager captures, per mode",
)  # fmt: skip
V2_CAPTURE_MEM_SAMPLES = _entry(
    _V2_GRAPHS, "CudaGraphManager._capture_mem_samples", INSTANCE_ATTRIBUTE, None,
    "set while vLLM samples graph memory; the bridge profiles then",
)  # fmt: skip
V2_GRAPHS_CAPTURED = _entry(
    _V2_GRAPHS, "CudaGraphManager._graphs_captured", INSTANCE_ATTRIBUTE, None,
    "whether the manager's graphs are captured",
)  # fmt: skip
V2_SPECULATOR_PROPOSE = _entry(
    _V2_SPECULATOR, "BaseSpeculator.propose", METHOD,
    _names(
        "self input_batch attn_metadata slot_mappings last_hidden_states aux_hidden_states "
        "num_sampled num_rejected last_sampled next_prefill_tokens temperature seeds dp_sync_state "
        "dummy_run skip_attn_for_dummy_run mm_inputs is_profile num_speculative_tokens"
    ),
    "wrapped on the instance: hands the target step's metadata to the draft graphs",
)  # fmt: skip
V2_SPECULATOR_BUILD_ATTN_METADATA = _entry(
    _V2_SPECULATOR, "DraftModelSpeculator._build_attn_metadata", METHOD,
    _names(
        "self num_reqs batch_desc query_start_loc_np seq_lens_cpu_upper_bound step causal "
        "dcp_local_seq_lens slot_mappings"
    ),
    "wrapped on the instance: hands each draft step's metadata to the draft graphs",
)  # fmt: skip
V2_MODEL_STATE_PREPARE_ATTN = _entry(
    "vllm.v1.worker.gpu.model_states.interface", "ModelState.prepare_attn", METHOD,
    _names(
        "self input_batch cudagraph_mode block_tables slot_mappings attn_groups kv_cache_config "
        "for_capture ubatch_idx"
    ),
    "wrapped on the instance: hands each step's metadata to the graph manager",
)  # fmt: skip
V2_PCP_LOCAL_BLOCK_TABLES = _entry(
    "vllm.v1.worker.gpu.pcp_manager", "PCPManager._local_block_tables", INSTANCE_ATTRIBUTE,
    None, "each rank's local block rows under prefill context parallelism (host mode)",
)  # fmt: skip


def _kernel(
    module: str,
    name: str,
    params: tuple[str, ...],
    params_from: tuple[str, tuple[str, ...]] | None = None,
) -> Internal:
    why = "a V2 Triton kernel host mode replaces by a PyTorch copy (kernel dispatcher key)"
    return Internal(module, name, TRITON_KERNEL, params, why, params_from=params_from)


_V2 = "vllm.v1.worker.gpu"
_TDAR = f"{_V2}.spec_decode.target_dependent_ar.speculator"
# fmt: off
V2_KERNELS = (
    _kernel(f"{_V2}.input_batch", "_prepare_pos_seq_lens_kernel", _names(
        "pos_ptr seq_lens_ptr idx_mapping_ptr query_start_loc_ptr num_computed_tokens_ptr "
        "max_num_reqs BLOCK_SIZE"
    )),
    _kernel(f"{_V2}.input_batch", "_combine_sampled_and_draft_tokens_kernel", _names(
        "input_ids_ptr idx_mapping_ptr last_sampled_tokens_ptr query_start_loc_ptr seq_lens_ptr "
        "prefill_len_ptr draft_tokens_ptr draft_tokens_stride cu_num_logits_ptr logits_indices_ptr "
        "BLOCK_SIZE NUM_NEW_SAMPLED_TOKENS"
    )),
    _kernel(f"{_V2}.input_batch", "_get_num_sampled_and_rejected_kernel", _names(
        "num_sampled_ptr num_rejected_ptr seq_lens_ptr cu_num_logits_ptr idx_mapping_ptr "
        "prefill_len_ptr"
    )),
    _kernel(f"{_V2}.input_batch", "_post_update_kernel", _names(
        "idx_mapping_ptr num_computed_tokens_ptr last_sampled_tokens_ptr output_bin_counts_ptr "
        "output_bin_counts_stride sampled_tokens_ptr sampled_tokens_stride num_sampled_ptr "
        "num_rejected_ptr query_start_loc_ptr all_token_ids_ptr all_token_ids_stride total_len_ptr"
    ), ("0.33.0", _names(
        "idx_mapping_ptr num_computed_tokens_ptr last_sampled_tokens_ptr output_bin_counts_ptr "
        "output_bin_counts_stride sampled_tokens_ptr sampled_tokens_stride num_sampled_ptr "
        "num_rejected_ptr query_start_loc_ptr all_token_ids_ptr all_token_ids_stride total_len_ptr "
        "draft_tokens_ptr draft_tokens_out_ptr num_draft_tokens"
    ))),
    _kernel(f"{_V2}.block_table", "_gather_block_tables_kernel", _names(
        "batch_idx_to_req_idx src_block_table_ptrs dst_block_table_ptrs block_table_strides "
        "num_blocks_ptr num_blocks_stride num_reqs BLOCK_SIZE"
    ), ("0.33.0", _names(
        "batch_idx_to_req_idx src_block_table_ptrs dst_block_table_ptrs block_table_strides "
        "num_blocks_ptr num_blocks_stride num_reqs num_computed_tokens_ptr "
        "sliding_window_reach_ptr block_sizes_ptr MASK_SLIDING_WINDOW BLOCK_SIZE"
    ))),
    _kernel(f"{_V2}.block_table", "_compute_slot_mappings_kernel", _names(
        "max_num_tokens idx_mapping query_start_loc pos block_table_ptrs block_table_strides "
        "block_sizes slot_mapping_enabled dcp_sharded slot_mappings_ptr slot_mappings_stride "
        "cp_rank CP_SIZE CP_INTERLEAVE PAD_ID TRITON_BLOCK_SIZE"
    )),
    _kernel(f"{_V2}.buffer_utils", "_apply_write_kernel", _names(
        "output_ptr output_stride write_indices_ptr write_starts_ptr write_contents_ptr "
        "write_cu_lens_ptr write_group_ids_ptr BLOCK_SIZE MULTI_GROUP"
    )),
    _kernel(f"{_V2}.sample.gumbel", "_gumbel_sample_kernel", _names(
        "local_argmax_ptr local_argmax_stride local_max_ptr local_max_stride logits_cache_ptr "
        "logits_cache_stride_0 logits_cache_stride_1 logits_cache_col_ptr logits_cache_source_ptr "
        "logits_cache_source_stride logits_ptr logits_stride expanded_idx_mapping_ptr seeds_ptr "
        "pos_ptr temp_ptr vocab_size BLOCK_SIZE IS_DRAFTING APPLY_TEMPERATURE USE_FP64 "
        "PER_TOKEN_COL"
    )),
    _kernel(_TDAR, "_update_draft_inputs_kernel", _names(
        "output_draft_tokens_ptr output_draft_tokens_stride next_input_hidden_states_ptr "
        "next_input_hidden_states_stride input_ids_ptr positions_ptr sample_src_positions_ptr "
        "seq_lens_ptr draft_tokens_ptr current_draft_step_ptr hidden_states_ptr "
        "hidden_states_stride hidden_size max_model_len num_speculative_steps BLOCK_SIZE "
        "ADVANCE_DRAFT_POSITIONS"
    )),
    _kernel(f"{_V2}.spec_decode.multi_module_mtp.speculator", "_cache_inputs_kernel", _names(
        "draft_input_ids_ptr draft_input_embeds_ptr draft_input_embeds_stride0 "
        "draft_input_hidden_states_ptr draft_input_hidden_states_stride0 "
        "cached_draft_input_ids_ptr cached_draft_input_ids_stride0 cached_draft_input_embeds_ptr "
        "cached_draft_input_embeds_stride0 cached_draft_input_embeds_stride1 "
        "cached_target_hidden_states_ptr cached_target_hidden_states_stride0 "
        "cached_target_hidden_states_stride1 idx_mapping_ptr last_token_indices_ptr "
        "query_start_loc_ptr num_speculative_steps hidden_size BLOCK_SIZE USE_INPUT_EMBEDS"
    )),
    _kernel(f"{_V2}.spec_decode.multi_module_mtp.speculator", "_shift_input_ids_kernel", _names(
        "input_ids_ptr idx_mapping_ptr query_start_loc_ptr last_token_indices_ptr draft_tokens_ptr "
        "BLOCK_SIZE"
    )),
    _kernel(f"{_V2}.spec_decode.ngram.speculator", "_ngram_scan_kernel", _names(
        "token_ids_ptr token_ids_stride idx_mapping_ptr total_len_ptr num_sampled_ptr scratch_ptr "
        "scratch_stride L MIN_N MAX_N MAX_N_PO2 BLOCK_L"
    )),
    _kernel(f"{_V2}.spec_decode.ngram.speculator", "_ngram_finalize_kernel", _names(
        "token_ids_ptr token_ids_stride idx_mapping_ptr total_len_ptr num_sampled_ptr "
        "last_sampled_ptr scratch_ptr scratch_stride drafts_ptr L N_BLOCKS K K_PO2 N_BLOCKS_PO2"
    )),
)
# fmt: on

# --- workers, MoE, collectives, host mode --------------------------------------------

_GPU_WORKER = "vllm.v1.worker.gpu_worker"
WORKER_INIT_WORKSPACE_AND_MODEL_RUNNER = _entry(
    _GPU_WORKER, "Worker._init_workspace_and_model_runner", METHOD, _names("self"),
    "the NPU worker's init_device ends as vLLM's does",
)  # fmt: skip
WORKER_MAKE_MODEL_RUNNER = _entry(
    _GPU_WORKER, "Worker._make_model_runner", METHOD, _names("self"),
    "overridden: the NPU worker builds the bridge's model runner",
)  # fmt: skip
_MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
MOE_SHARED_EXPERTS = _entry(
    _MOE_RUNNER, "MoERunner._shared_experts", INSTANCE_ATTRIBUTE, None,
    "whether a MoE runner has shared experts (which custom op its forward goes through)",
)  # fmt: skip
MOE_FORWARD_ENTRY = _entry(
    _MOE_RUNNER, "MoERunner._forward_entry", INSTANCE_ATTRIBUTE, None,
    "a MoE runner's forward, pointed at vLLM's moe_forward custom op (data parallel)",
)  # fmt: skip
CPU_COMMUNICATOR_DIST_MODULE = _entry(
    "vllm.distributed.device_communicators.cpu_communicator", "CpuCommunicator.dist_module",
    INSTANCE_ATTRIBUTE, None,
    "the host communicator's collectives, replaced by ones host graphs record",
)  # fmt: skip
CPU_COMPUTE_SLOT_MAPPING = _entry(
    "vllm.utils.cpu_triton_utils", "_compute_slot_mapping_kernel_impl", FUNCTION,
    _names(
        "num_tokens max_num_tokens query_start_loc positions block_table block_table_stride "
        "slot_mapping KV_CACHE_BLOCK_SIZE TOTAL_CP_WORLD_SIZE TOTAL_CP_RANK "
        "CP_KV_CACHE_INTERLEAVE_SIZE PAD_ID BLOCK_SIZE"
    ),
    "vLLM's CPU slot mapping, which host mode runs for one context-parallel rank",
)  # fmt: skip
CPU_SGL_GEMM_CHECK = _entry(
    "vllm.model_executor.layers.utils", "check_cpu_sgl_kernel", FUNCTION, _names("n k dtype"),
    "replaced in host mode without vllm._C: vLLM's CPU linear dispatch asks it whether to "
    "pack a weight for the compiled SGL GEMM (convert_weight_packed, weight_packed_linear)",
)  # fmt: skip
COMPUTE_SLOT_MAPPING_KERNEL = Internal(
    "vllm.v1.worker.block_table", "ComputeSlotMappingKernel.kernel", TRITON_KERNEL,
    _names(
        "num_tokens max_num_tokens query_start_loc_ptr positions_ptr block_table_ptr "
        "block_table_stride slot_mapping_ptr KV_CACHE_BLOCK_SIZE TOTAL_CP_WORLD_SIZE "
        "TOTAL_CP_RANK CP_KV_CACHE_INTERLEAVE_SIZE PAD_ID BLOCK_SIZE"
    ),
    "V1's slot-mapping kernel, which host mode replaces by a PyTorch version that takes "
    "decode context parallelism (kernel dispatcher key)",
)  # fmt: skip


def _op(name: str, params: tuple[str, ...] | None, why: str) -> Internal:
    return _entry("vllm._C", name, COMPILED_OP, params, why)


_RECORDED = "recorded whole in host graphs where this build has it"
_DEFINED = "defined by host mode under vLLM's name and schema where vllm._C is not built"
# fmt: off
COMPILED_OPS = (
    _op("shm_allreduce", _names("handle data"), _RECORDED),
    _op("shm_all_gather", _names("handle data output"), _RECORDED),
    _op("onednn_mm", _names("c a bias handler_tensor"), _RECORDED),
    _op("weight_packed_linear", _names("out mat1 mat2 bias is_vnni"), _RECORDED),
    _op("cpu_fused_moe", _names(
        "output input w13 w2 w13_bias w2_bias topk_weights topk_id skip_weighted act isa"
    ), _RECORDED + "; " + _DEFINED),
    _op("prepack_moe_weight", _names("weight packed_weight isa"), _DEFINED),
    _op("rotary_embedding", _names(
        "positions query key head_size cos_sin_cache is_neox rope_dim_offset inverse"
    ), _RECORDED),
    _op("init_cpu_memory_env", _names("node_ids"), _DEFINED),
    _op("compute_slot_mapping_kernel_impl", _names(
        "query_start_loc positions block_table slot_mapping block_size"
    ), _DEFINED),
    _op("greedy_argmax", _names("logits"), _DEFINED),
    _op("fused_gumbel_argmax", _names("logits seeds"), _DEFINED),
    _op("rejection_greedy_sample_kernel_impl", _names(
        "output_token_ids cu_num_draft_tokens draft_token_ids target_argmax bonus_token_ids "
        "is_greedy max_spec_len"
    ), _DEFINED),
    _op("rejection_random_sample_kernel_impl", _names(
        "output_token_ids cu_num_draft_tokens draft_token_ids draft_probs target_probs "
        "bonus_token_ids recovered_token_ids uniform_probs is_greedy max_spec_len vocab_size "
        "no_draft_probs"
    ), _DEFINED),
    _op("expand_kernel_impl", _names(
        "output input cu_num_tokens replace_from replace_to"
    ), _DEFINED),
    _op("sample_recovered_tokens_kernel_impl", _names(
        "output_token_ids cu_num_draft_tokens draft_token_ids draft_probs target_probs inv_q "
        "vocab_size no_draft_probs"
    ), _DEFINED),
    _op("eagle_prepare_inputs_padded_kernel_impl", _names(
        "cu_num_draft_tokens valid_sampled_tokens_count query_start_loc_gpu "
        "token_indices_to_sample num_rejected_tokens_gpu num_reqs"
    ), _DEFINED),
    _op("eagle_prepare_next_token_padded_kernel_impl", _names(
        "sampled_token_ids discard_request_mask backup_next_token_ids next_token_ids "
        "valid_sampled_tokens_count vocab_size num_sampled_tokens_per_req num_reqs"
    ), _DEFINED),
    _op("eagle_step_slot_mapping_metadata_kernel_impl", _names(
        "positions block_table seq_lens out_clamped_positions out_slot_mapping block_size "
        "max_model_len PAD_ID"
    ), _DEFINED),
    _op("copy_and_expand_eagle_inputs_kernel_impl", _names(
        "target_token_ids target_positions next_token_ids out_input_ids out_positions "
        "out_is_rejected_token_mask out_is_masked_token_mask out_new_token_indices "
        "out_hidden_state_mapping query_start_loc query_end_loc padding_token_id "
        "parallel_drafting_token_id total_input_tokens num_padding_slots_per_request "
        "shift_input_ids"
    ), _DEFINED),
)
# fmt: on
# torch.ops' namespace of vLLM's compiled ops (vllm._C's).
COMPILED_OPS_NAMESPACE = "_C"
COMPILED_OPS_MODULE = "vllm._C"

INTERNALS: tuple[Internal, ...] = (
    ATTN_K_SCALE,
    ATTN_V_SCALE,
    BUILDER_CUDAGRAPH_SUPPORT,
    BUILDER_INIT_REORDER_BATCH_THRESHOLD,
    SELECTOR_ASDICT,
    MLA_DCP_MANAGER,
    FORWARD_CONTEXT,
    DBO_CURRENT_UBATCH_ID,
    DBO_CURRENT_UBATCH_TOKEN_OFFSET,
    GPU_RUNNER_UBATCH_WRAPPER,
    V2_UBATCH_RUNNER,
    DBO_UNSUPPORTED_FEATURES,
    DP_METADATA_MAKE,
    V2_DISPATCH_CG_AND_SYNC_DP,
    V1_WARMUP_AND_CAPTURE,
    V1_INIT_MINIMAL_KV_CACHE_FOR_PROFILING,
    V1_CLEANUP_PROFILING_KV_CACHE,
    COMPILATION_COUNTER_CUDAGRAPHS,
    V2_MODEL_GRAPH_MANAGER,
    V2_TDAR_SPECULATOR_GRAPH_MANAGER,
    V2_MTP_SPECULATOR_GRAPH_MANAGER,
    V2_CAPTURE_DESCS,
    V2_CAPTURE_MEM_SAMPLES,
    V2_GRAPHS_CAPTURED,
    V2_SPECULATOR_PROPOSE,
    V2_SPECULATOR_BUILD_ATTN_METADATA,
    V2_MODEL_STATE_PREPARE_ATTN,
    V2_PCP_LOCAL_BLOCK_TABLES,
    *V2_KERNELS,
    WORKER_INIT_WORKSPACE_AND_MODEL_RUNNER,
    WORKER_MAKE_MODEL_RUNNER,
    MOE_SHARED_EXPERTS,
    MOE_FORWARD_ENTRY,
    CPU_COMMUNICATOR_DIST_MODULE,
    CPU_COMPUTE_SLOT_MAPPING,
    CPU_SGL_GEMM_CHECK,
    COMPUTE_SLOT_MAPPING_KERNEL,
    *COMPILED_OPS,
)


# --- generic accessors ---------------------------------------------------------------


def _check_kind(entry: Internal, *kinds: str) -> None:
    if not isinstance(entry, Internal):
        raise TypeError(f"expected a vllm_seam.Internal, got {type(entry).__name__}")
    if entry.kind not in kinds:
        raise ValueError(f"expected an entry of kind {' or '.join(kinds)}, got {entry}")


def call_method(obj: Any, entry: Internal, *args: Any, **kwargs: Any) -> Any:
    """``obj.<entry.name>(*args, **kwargs)``: a private vLLM method of ``obj``."""
    _check_kind(entry, METHOD)
    return getattr(obj, entry.name)(*args, **kwargs)


def get_attribute(obj: Any, entry: Internal, *default: Any) -> Any:
    """``obj.<entry.name>`` (``getattr`` with ``default`` when given)."""
    _check_kind(entry, INSTANCE_ATTRIBUTE, CLASS_ATTRIBUTE, METHOD)
    return getattr(obj, entry.name, *default)


def set_attribute(obj: Any, entry: Internal, value: Any) -> None:
    """``obj.<entry.name> = value`` on a vLLM object."""
    _check_kind(entry, INSTANCE_ATTRIBUTE)
    setattr(obj, entry.name, value)


def wrap_instance_method(
    obj: Any, entry: Internal, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[..., Any]:
    """Replace the method ``entry`` on the instance ``obj`` by ``wrap(original)``, the
    original being the bound method; returns the original."""
    _check_kind(entry, METHOD)
    original = getattr(obj, entry.name)
    setattr(obj, entry.name, wrap(original))
    return original


@contextlib.contextmanager
def swap_module_attribute(entry: Internal, replacement: Any) -> Iterator[None]:
    """In the enclosed block, ``entry``'s module names ``replacement`` in its place
    (a class vLLM instantiates there, looked up at call time)."""
    _check_kind(entry, CLASS, FUNCTION, MODULE_ATTRIBUTE)
    with mock.patch.object(importlib.import_module(entry.module), entry.qualname, replacement):
        yield


def rebind_in_loaded_modules(replacements: dict[Internal, Callable[..., Any]]) -> list[str]:
    """Point every loaded ``vllm.*`` module that imported one of these functions by
    name at its replacement (entries this vLLM lacks are skipped); returns the
    ``module.name`` s rebound."""
    originals = {}
    for entry, ours in replacements.items():
        _check_kind(entry, FUNCTION)
        owner = importlib.import_module(entry.module)
        if hasattr(owner, entry.name):
            originals[entry.name] = (getattr(owner, entry.name), ours, owner)
    patched = []
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("vllm."):
            continue
        for name, (original, ours, owner) in originals.items():
            if module is not owner and getattr(module, name, None) is original:
                setattr(module, name, ours)
                patched.append(f"{module_name}.{name}")
    return patched


# --- named accessors -----------------------------------------------------------------


def layer_kv_scales(layer: Any) -> tuple[Any, Any]:
    """The layer's per-tensor (key, value) scales (:data:`ATTN_K_SCALE`, :data:`ATTN_V_SCALE`)."""
    return get_attribute(layer, ATTN_K_SCALE), get_attribute(layer, ATTN_V_SCALE)


def builder_cudagraph_support(builder_cls: type) -> Any:
    """The builder class's own graph support (:data:`BUILDER_CUDAGRAPH_SUPPORT`)."""
    return get_attribute(builder_cls, BUILDER_CUDAGRAPH_SUPPORT)


def init_reorder_batch_threshold(builder: Any, *args: Any, **kwargs: Any) -> None:
    """vLLM's (:data:`BUILDER_INIT_REORDER_BATCH_THRESHOLD`) on ``builder``."""
    call_method(builder, BUILDER_INIT_REORDER_BATCH_THRESHOLD, *args, **kwargs)


def selector_fields(selector: Any) -> dict[str, Any]:
    """The selector's fields by name (:data:`SELECTOR_ASDICT`)."""
    return call_method(selector, SELECTOR_ASDICT)


def set_mla_dcp_manager(layer: Any, manager: Any) -> None:
    """Give an MLA layer ``manager`` as its DCP manager (:data:`MLA_DCP_MANAGER`)."""
    set_attribute(layer, MLA_DCP_MANAGER, manager)


def install_forward_context(context: Any) -> None:
    """Make ``context`` vLLM's current forward context (:data:`FORWARD_CONTEXT`), as
    ``set_forward_context`` does on entry, without its exit."""
    setattr(importlib.import_module(FORWARD_CONTEXT.module), FORWARD_CONTEXT.name, context)


def ubatch_wrapper_bypassed(stand_in: type) -> contextlib.AbstractContextManager[None]:
    """vLLM's V1 runner builds ``stand_in`` for its ``UBatchWrapper`` in the block
    (:data:`GPU_RUNNER_UBATCH_WRAPPER`)."""
    return swap_module_attribute(GPU_RUNNER_UBATCH_WRAPPER, stand_in)


def dbo_unsupported_features(vllm_config: Any) -> list[str]:
    """What vLLM's V2 runner does not micro-batch in ``vllm_config``
    (:data:`DBO_UNSUPPORTED_FEATURES`; ``["dual batch overlap"]`` unless
    ``VLLM_USE_V2_MODEL_RUNNER`` is set)."""
    return call_method(vllm_config, DBO_UNSUPPORTED_FEATURES)


@contextlib.contextmanager
def dp_metadata_make_inside(
    around: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Iterator[None]:
    """In the enclosed block, vLLM's ``DPMetadata.make`` (:data:`DP_METADATA_MAKE`) runs
    inside ``around()``."""
    _check_kind(DP_METADATA_MAKE, METHOD)
    cls = importlib.import_module(DP_METADATA_MAKE.module).DPMetadata
    make = cls.make

    def make_inside(*args: Any, **kwargs: Any) -> Any:
        with around():
            return make(*args, **kwargs)

    with mock.patch.object(cls, "make", staticmethod(make_inside)):
        yield


def v2_ubatch_runner_buffers(
    runner: Any,
    vllm_config: Any,
    device: Any,
    model_state: Any,
    attn_groups: Any,
    kv_cache_config: Any,
    max_num_reqs: int,
) -> None:
    """What vLLM's V2 ``UBatchRunner.prepare`` reads of its runner, as vLLM's constructor
    sets it, less :data:`V2_UBATCH_RUNNER_CUDA_ATTRIBUTES` (left None): the config, the
    model state and attention groups, and each micro-batch's ``query_start_loc`` /
    ``seq_lens`` buffers (``prepare`` rebases the micro-batch onto them).

    Raises:
        ValueError: decode context parallelism (vLLM does not micro-batch it).
    """
    import torch

    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size > 1:
        raise ValueError(
            "micro-batch overlap with decode_context_parallel_size=1 expected, got "
            f"{parallel.decode_context_parallel_size}"
        )
    count = parallel.num_ubatches
    runner.vllm_config, runner.parallel_config = vllm_config, parallel
    runner.num_ubatches = count
    runner.dcp_size, runner.dcp_rank = 1, 0
    runner.cp_interleave = parallel.cp_kv_cache_interleave_size
    runner.device, runner.model_state = device, model_state
    runner.attn_groups, runner.kv_cache_config = attn_groups, kv_cache_config

    def buffers(size: int) -> list[Any]:
        return [torch.zeros(size, dtype=torch.int32, device=device) for _ in range(count)]

    runner.ubatch_query_start_loc = buffers(max_num_reqs + 1)
    runner.ubatch_seq_lens = buffers(max_num_reqs)
    runner.ubatch_dcp_local_seq_lens = [None] * count
    for name in V2_UBATCH_RUNNER_CUDA_ATTRIBUTES:
        setattr(runner, name, None)


def warmup_and_capture(runner: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM V1's capture of one descriptor (:data:`V1_WARMUP_AND_CAPTURE`)."""
    return call_method(runner, V1_WARMUP_AND_CAPTURE, *args, **kwargs)


def init_minimal_kv_cache_for_profiling(runner: Any) -> None:
    """:data:`V1_INIT_MINIMAL_KV_CACHE_FOR_PROFILING` on ``runner``."""
    call_method(runner, V1_INIT_MINIMAL_KV_CACHE_FOR_PROFILING)


def cleanup_profiling_kv_cache(runner: Any) -> None:
    """:data:`V1_CLEANUP_PROFILING_KV_CACHE` on ``runner``."""
    call_method(runner, V1_CLEANUP_PROFILING_KV_CACHE)


def set_cudagraphs_captured_count(count: int) -> None:
    """vLLM's compilation counter of captured graphs (:data:`COMPILATION_COUNTER_CUDAGRAPHS`)."""
    set_attribute(COMPILATION_COUNTER_CUDAGRAPHS.owner(), COMPILATION_COUNTER_CUDAGRAPHS, count)


def capture_descs(manager: Any) -> Any:
    """A V2 graph manager's descriptors per mode (:data:`V2_CAPTURE_DESCS`)."""
    return get_attribute(manager, V2_CAPTURE_DESCS)


def capture_mem_samples(manager: Any) -> Any:
    """A V2 graph manager's memory samples, None outside vLLM's sampling
    (:data:`V2_CAPTURE_MEM_SAMPLES`)."""
    return get_attribute(manager, V2_CAPTURE_MEM_SAMPLES)


def graphs_captured(manager: Any) -> bool:
    """Whether a V2 graph manager's graphs are captured (:data:`V2_GRAPHS_CAPTURED`)."""
    return get_attribute(manager, V2_GRAPHS_CAPTURED)


def set_graphs_captured(manager: Any, captured: bool) -> None:
    """:data:`V2_GRAPHS_CAPTURED` of a V2 graph manager."""
    set_attribute(manager, V2_GRAPHS_CAPTURED, captured)


def pcp_local_block_tables(pcp_manager: Any) -> Any:
    """Each rank's local block tables, None without them (:data:`V2_PCP_LOCAL_BLOCK_TABLES`)."""
    return get_attribute(pcp_manager, V2_PCP_LOCAL_BLOCK_TABLES, None)


def v2_kernel_path(name: str) -> str:
    """The dispatcher key (``module.name``) of V2's Triton kernel ``name`` (one of
    :data:`V2_KERNELS`)."""
    for entry in V2_KERNELS:
        if entry.name == name:
            return entry.path
    raise ValueError(f"expected one of V2's kernels {[e.name for e in V2_KERNELS]}, got {name!r}")


def init_workspace_and_model_runner(worker: Any) -> None:
    """:data:`WORKER_INIT_WORKSPACE_AND_MODEL_RUNNER` on ``worker``."""
    call_method(worker, WORKER_INIT_WORKSPACE_AND_MODEL_RUNNER)


def moe_has_shared_experts(runner: Any) -> bool:
    """Whether a MoE runner has shared experts (:data:`MOE_SHARED_EXPERTS`)."""
    return get_attribute(runner, MOE_SHARED_EXPERTS) is not None


def set_moe_forward_entry(runner: Any, forward: Any) -> None:
    """Point a MoE runner's forward at ``forward`` (:data:`MOE_FORWARD_ENTRY`)."""
    set_attribute(runner, MOE_FORWARD_ENTRY, forward)


def cpu_compute_slot_mapping(*args: Any, **kwargs: Any) -> None:
    """vLLM's CPU slot mapping (:data:`CPU_COMPUTE_SLOT_MAPPING`)."""
    module = importlib.import_module(CPU_COMPUTE_SLOT_MAPPING.module)
    getattr(module, CPU_COMPUTE_SLOT_MAPPING.name)(*args, **kwargs)


def cpu_sgl_gemm_check() -> Callable[..., bool]:
    """The function vLLM's CPU linear dispatch asks now (:data:`CPU_SGL_GEMM_CHECK`)."""
    return getattr(importlib.import_module(CPU_SGL_GEMM_CHECK.module), CPU_SGL_GEMM_CHECK.name)


def set_cpu_sgl_gemm_check(check: Callable[..., bool]) -> Callable[..., bool]:
    """Have vLLM's CPU linear dispatch ask ``check(n, k, dtype)`` whether a weight takes
    the packed-weight SGL GEMM, in place of :data:`CPU_SGL_GEMM_CHECK` (looked up at
    dispatch, in its own module); returns the function it replaces."""
    module = importlib.import_module(CPU_SGL_GEMM_CHECK.module)
    original = getattr(module, CPU_SGL_GEMM_CHECK.name)
    setattr(module, CPU_SGL_GEMM_CHECK.name, check)
    return original


def compiled_ops_present() -> bool:
    """Whether this vLLM build has its compiled ops (:data:`COMPILED_OPS_MODULE`)."""
    return importlib.util.find_spec(COMPILED_OPS_MODULE) is not None


def compiled_op(name: str) -> Any:
    """``torch.ops._C.<name>`` (one of :data:`COMPILED_OPS`), None where this build
    has no such op."""
    if name not in {entry.name for entry in COMPILED_OPS}:
        raise ValueError(
            f"expected one of vLLM's compiled ops {[e.name for e in COMPILED_OPS]}, got {name!r}"
        )
    import torch

    return getattr(getattr(torch.ops, COMPILED_OPS_NAMESPACE), name, None)
