"""PyTorch versions of vLLM's compiled CPU ops that host mode reaches, for a vLLM
built without them.

Ascend hosts build vLLM from its sdist with ``VLLM_TARGET_DEVICE=empty``: pure Python,
no ``vllm._C``. Host mode runs on vLLM's CPU worker and sampler, which call a few of
``vllm._C``'s CPU ops. Where ``vllm._C`` does not exist, :func:`register_missing`
defines each of them under its own name and schema (``torch.ops._C.<name>``) with the
PyTorch function here:

* ``init_cpu_memory_env``: what vLLM's op does when built without NUMA support
  (``VLLM_NUMA_DISABLED``): memory stays where the OS puts it; the node ids are checked;
* ``compute_slot_mapping_kernel_impl``: the bridge's own slot mapping of one rank
  (``slot_mapping.scheduled_slots``);
* ``greedy_argmax``: the first largest logit of each row;
* ``fused_gumbel_argmax``: Gumbel-max sampling with a generator per row seeded by the
  row's seed (the same distribution as the compiled op, not the same random stream);
* V1 speculative decoding's kernels, which vLLM's CPU platform calls in place of their
  Triton versions: rejection sampling (greedy, random, recovered tokens, ``expand``)
  and EAGLE's input preparation (``spec_ops.py``);
* the CPU MoE experts, ``prepack_moe_weight`` and ``cpu_fused_moe``
  (``moe_ops.py``).

And two are avoided instead:

* ``rotary_embedding`` (vLLM's rotary layer calls it on CPU with custom ops on):
  :func:`avoid_missing_custom_ops` has vLLM use its PyTorch rotary embedding;
* the packed-weight SGL GEMM (``convert_weight_packed``, ``weight_packed_linear``),
  which vLLM's CPU linear dispatch picks for small bf16/fp16 weights on AMX CPUs:
  :func:`avoid_missing_packed_gemm` sends those layers where vLLM sends every other
  layer of an empty build (it has no oneDNN either), to ``torch.nn.functional.linear``
  on the unpacked weight. A PyTorch version of the pair would rebuild vLLM's VNNI
  layout only to undo it at every call, and could at best equal this linear.

vLLM's own CPU attention backends are not among them: an empty build has no CPU
platform of its own, so they cannot be selected.

Model Runner V2's kernels run as PyTorch versions or under Triton's interpreter
(``v2_kernels.py``).

Where ``vllm._C`` exists nothing here acts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from npu_vllm_bridge import vllm_seam
from npu_vllm_bridge.host import moe_ops, spec_ops
from npu_vllm_bridge.host.slot_mapping import scheduled_slots

NAMESPACE = vllm_seam.COMPILED_OPS_NAMESPACE
ROTARY_OP = "rotary_embedding"


def init_cpu_memory_env(node_ids: Sequence[int]) -> None:
    """Bind this process's memory to NUMA ``node_ids``: as vLLM's op built without NUMA
    support, placement is left to the OS. Raises ``ValueError`` for a negative id."""
    bad = [node for node in node_ids if int(node) < 0]
    if bad:
        raise ValueError(f"init_cpu_memory_env takes NUMA node ids >= 0, got {list(node_ids)}")


def compute_slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """Write the slot of each scheduled token (``query_start_loc[-1]`` of them) into
    ``slot_mapping`` (int64); entries after them are left as they are.

    ``query_start_loc``: int32 ``[num_reqs + 1]``; ``positions``: int64 ``[>= tokens]``;
    ``block_table``: int32 ``[max_num_reqs, max_num_blocks_per_req]``.
    """
    slots = scheduled_slots(query_start_loc, positions, block_table, int(block_size))
    slot_mapping[: slots.numel()] = slots.to(slot_mapping.dtype)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows]``: each row's index of its largest logit (the first, on ties)."""
    return logits.argmax(dim=-1).view(-1)


def fused_gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows]``: a token per row of float32 ``logits [rows, vocab]``, drawn from
    ``softmax(logits)`` by the Gumbel-max rule with a generator seeded by ``seeds[row]``
    (int64 ``[rows]``): the same seed and logits give the same token."""
    if logits.dim() != 2 or seeds.shape != logits.shape[:1]:
        raise ValueError(
            "fused_gumbel_argmax takes logits [rows, vocab] and seeds [rows], got "
            f"{tuple(logits.shape)} and {tuple(seeds.shape)}"
        )
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    generator = torch.Generator()
    for row, seed in enumerate(seeds.tolist()):
        generator.manual_seed(int(seed))
        uniform = torch.rand(logits.shape[1], generator=generator, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(uniform.clamp(min=torch.finfo(torch.float64).tiny)))
        tokens[row] = torch.argmax(logits[row].double() + gumbel)
    return tokens


# vLLM's op name -> (its schema, as vllm._C defines it; the PyTorch version).
OPS: dict[str, tuple[str, Callable[..., Any]]] = {
    "init_cpu_memory_env": ("init_cpu_memory_env(SymInt[] node_ids) -> ()", init_cpu_memory_env),
    "compute_slot_mapping_kernel_impl": (
        "compute_slot_mapping_kernel_impl(Tensor query_start_loc, Tensor positions, "
        "Tensor block_table, Tensor(a!) slot_mapping, SymInt block_size) -> ()",
        compute_slot_mapping,
    ),
    "greedy_argmax": ("greedy_argmax(Tensor logits) -> Tensor", greedy_argmax),
    "fused_gumbel_argmax": (
        "fused_gumbel_argmax(Tensor logits, Tensor seeds) -> Tensor",
        fused_gumbel_argmax,
    ),
    "rejection_greedy_sample_kernel_impl": (
        "rejection_greedy_sample_kernel_impl(Tensor(a0!) output_token_ids, "
        "Tensor cu_num_draft_tokens, Tensor draft_token_ids, Tensor target_argmax, "
        "Tensor bonus_token_ids, Tensor? is_greedy, SymInt max_spec_len) -> ()",
        spec_ops.rejection_greedy_sample,
    ),
    "rejection_random_sample_kernel_impl": (
        "rejection_random_sample_kernel_impl(Tensor(a0!) output_token_ids, "
        "Tensor cu_num_draft_tokens, Tensor draft_token_ids, Tensor? draft_probs, "
        "Tensor target_probs, Tensor bonus_token_ids, Tensor recovered_token_ids, "
        "Tensor uniform_probs, Tensor? is_greedy, SymInt max_spec_len, SymInt vocab_size, "
        "bool no_draft_probs) -> ()",
        spec_ops.rejection_random_sample,
    ),
    "expand_kernel_impl": (
        "expand_kernel_impl(Tensor(a0!) output, Tensor input, Tensor cu_num_tokens, "
        "SymInt replace_from, SymInt replace_to) -> ()",
        spec_ops.expand,
    ),
    "sample_recovered_tokens_kernel_impl": (
        "sample_recovered_tokens_kernel_impl(Tensor(a0!) output_token_ids, "
        "Tensor cu_num_draft_tokens, Tensor draft_token_ids, Tensor? draft_probs, "
        "Tensor target_probs, Tensor inv_q, SymInt vocab_size, bool no_draft_probs) -> ()",
        spec_ops.sample_recovered_tokens,
    ),
    "eagle_prepare_inputs_padded_kernel_impl": (
        "eagle_prepare_inputs_padded_kernel_impl(Tensor cu_num_draft_tokens, "
        "Tensor valid_sampled_tokens_count, Tensor query_start_loc_gpu, "
        "Tensor(a3!) token_indices_to_sample, Tensor(a4!) num_rejected_tokens_gpu, "
        "SymInt num_reqs) -> ()",
        spec_ops.eagle_prepare_inputs_padded,
    ),
    "eagle_prepare_next_token_padded_kernel_impl": (
        "eagle_prepare_next_token_padded_kernel_impl(Tensor sampled_token_ids, "
        "Tensor discard_request_mask, Tensor backup_next_token_ids, "
        "Tensor(a3!) next_token_ids, Tensor(a4!) valid_sampled_tokens_count, "
        "SymInt vocab_size, SymInt num_sampled_tokens_per_req, SymInt num_reqs) -> ()",
        spec_ops.eagle_prepare_next_token_padded,
    ),
    "eagle_step_slot_mapping_metadata_kernel_impl": (
        "eagle_step_slot_mapping_metadata_kernel_impl(Tensor positions, Tensor block_table, "
        "Tensor(a2!) seq_lens, Tensor(a3!) out_clamped_positions, "
        "Tensor(a4!) out_slot_mapping, SymInt block_size, SymInt max_model_len, "
        "SymInt PAD_ID) -> ()",
        spec_ops.eagle_step_slot_mapping_metadata,
    ),
    "copy_and_expand_eagle_inputs_kernel_impl": (
        "copy_and_expand_eagle_inputs_kernel_impl(Tensor target_token_ids, "
        "Tensor target_positions, Tensor next_token_ids, Tensor(a3!) out_input_ids, "
        "Tensor(a4!) out_positions, Tensor(a5!) out_is_rejected_token_mask, "
        "Tensor(a6!) out_is_masked_token_mask, Tensor(a7!) out_new_token_indices, "
        "Tensor(a8!) out_hidden_state_mapping, Tensor query_start_loc, "
        "Tensor query_end_loc, SymInt padding_token_id, SymInt parallel_drafting_token_id, "
        "SymInt total_input_tokens, SymInt num_padding_slots_per_request, "
        "bool shift_input_ids) -> ()",
        spec_ops.copy_and_expand_eagle_inputs,
    ),
    "prepack_moe_weight": (
        "prepack_moe_weight(Tensor weight, Tensor(a1!) packed_weight, str isa) -> ()",
        moe_ops.prepack_moe_weight,
    ),
    "cpu_fused_moe": (
        "cpu_fused_moe(Tensor(a0!) output, Tensor input, Tensor w13, Tensor w2, "
        "Tensor? w13_bias, Tensor? w2_bias, Tensor topk_weights, Tensor topk_id, "
        "bool skip_weighted, str act, str isa) -> ()",
        moe_ops.cpu_fused_moe,
    ),
}

_library: torch.library.Library | None = None
# vLLM's check_cpu_sgl_kernel once avoid_missing_packed_gemm has replaced it.
_vllm_packed_check: Callable[..., bool] | None = None


def compiled_ops_present() -> bool:
    """Whether this vLLM build has its compiled ops (``vllm._C``)."""
    return vllm_seam.compiled_ops_present()


def register_missing() -> list[str]:
    """Define the ops of :data:`OPS` under ``torch.ops._C`` when ``vllm._C`` does not
    exist; returns the names defined (none with ``vllm._C``, or when already done)."""
    global _library
    if _library is not None or compiled_ops_present():
        return []
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name, (schema, impl) in OPS.items():
        library.define(schema)
        library.impl(name, impl, "CompositeExplicitAutograd")
        # What Dynamo runs when it traces the op (cpu_fused_moe inside a compiled model):
        # shapes only, in-place ops write nothing.
        torch.library.register_fake(
            f"{NAMESPACE}::{name}", FAKES.get(name, _writes_only), lib=library
        )
    _library = library
    return list(OPS)


def _writes_only(*args: Any) -> None:
    """The fake of an op that returns nothing (it writes its mutable arguments)."""


def _one_token_per_row(logits: torch.Tensor, *args: Any) -> torch.Tensor:
    return logits.new_empty(logits.shape[:1], dtype=torch.int64)


FAKES: dict[str, Callable[..., Any]] = {
    "greedy_argmax": _one_token_per_row,
    "fused_gumbel_argmax": _one_token_per_row,
}


def avoid_missing_custom_ops(custom_ops: list[str]) -> list[str]:
    """Without ``vllm._C``, turn vLLM's custom ops whose CPU path calls a compiled op
    and have a PyTorch path of their own (``rotary_embedding``) off, unless the user
    chose; returns what was added to ``custom_ops`` (vLLM's compilation setting)."""
    if compiled_ops_present() or any(op.lstrip("+-") == ROTARY_OP for op in custom_ops):
        return []
    custom_ops.append(f"-{ROTARY_OP}")
    return [f"-{ROTARY_OP}"]


def never_packed(n: int, k: int, dtype: torch.dtype) -> bool:
    """vLLM's ``check_cpu_sgl_kernel`` where the packed-weight GEMM is not built: no
    weight ``[n, k]`` of any ``dtype`` takes it."""
    return False


def avoid_missing_packed_gemm() -> bool:
    """Without ``vllm._C``, have vLLM's CPU linear dispatch (``dispatch_cpu_unquantized_gemm``)
    skip the packed-weight SGL GEMM, so its layers run ``torch.nn.functional.linear``
    on their unpacked weights; returns whether it acted (not with ``vllm._C``)."""
    global _vllm_packed_check
    if compiled_ops_present():
        return False
    if _vllm_packed_check is None:
        _vllm_packed_check = vllm_seam.set_cpu_sgl_gemm_check(never_packed)
    return True


def vllm_packed_gemm_check() -> Callable[..., bool]:
    """vLLM's own ``check_cpu_sgl_kernel(n, k, dtype)``, also once
    :func:`avoid_missing_packed_gemm` has replaced it."""
    return _vllm_packed_check or vllm_seam.cpu_sgl_gemm_check()
