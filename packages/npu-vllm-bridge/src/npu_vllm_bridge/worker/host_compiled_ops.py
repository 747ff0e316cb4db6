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
  (``host_slot_mapping.scheduled_slots``);
* ``greedy_argmax``: the first largest logit of each row;
* ``fused_gumbel_argmax``: Gumbel-max sampling with a generator per row seeded by the
  row's seed (the same distribution as the compiled op, not the same random stream).

And one is avoided instead: ``rotary_embedding`` (vLLM's rotary layer calls it on CPU
with custom ops on); :func:`avoid_missing_custom_ops` has vLLM use its PyTorch rotary
embedding. vLLM's own CPU attention backends are not among them: an empty build has
no CPU platform of its own, so they cannot be selected.

Not covered: the CPU versions of V1's speculative-decoding kernels (rejection sampling,
EAGLE's input preparation), which vLLM's CPU platform takes from ``vllm._C`` too;
:func:`refuse_v1_speculation` stops such a run at start-up. Model Runner V2 runs
speculative decoding on an empty build (its kernels run as PyTorch versions or under
Triton's interpreter, ``host_v2_kernels.py``).

Where ``vllm._C`` exists nothing here acts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npu_vllm_bridge.settings import PREFIX
from npu_vllm_bridge.worker.host_slot_mapping import scheduled_slots

NAMESPACE = "_C"
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
}

_library: torch.library.Library | None = None


def compiled_ops_present() -> bool:
    """Whether this vLLM build has its compiled ops (``vllm._C``)."""
    return importlib.util.find_spec("vllm._C") is not None


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
    _library = library
    return list(OPS)


def avoid_missing_custom_ops(custom_ops: list[str]) -> list[str]:
    """Without ``vllm._C``, turn vLLM's custom ops whose CPU path calls a compiled op
    and have a PyTorch path of their own (``rotary_embedding``) off, unless the user
    chose; returns what was added to ``custom_ops`` (vLLM's compilation setting)."""
    if compiled_ops_present() or any(op.lstrip("+-") == ROTARY_OP for op in custom_ops):
        return []
    custom_ops.append(f"-{ROTARY_OP}")
    return [f"-{ROTARY_OP}"]


def refuse_v1_speculation(vllm_config: Any, v2: bool) -> None:
    """Raise ``ValueError`` for speculative decoding on V1 (``v2`` false) without
    ``vllm._C``: vLLM's CPU platform runs V1's rejection sampler and EAGLE input kernels
    as compiled ops, which an empty build lacks."""
    if v2 or compiled_ops_present() or vllm_config.speculative_config is None:
        return
    raise ValueError(
        f"{PREFIX} host mode on a vLLM built without its compiled ops (no vllm._C, as the "
        "empty build) runs speculative decoding on Model Runner V2 only "
        "(VLLM_USE_V2_MODEL_RUNNER=1): V1's rejection sampler and EAGLE input kernels "
        "on CPU are vllm._C ops; got speculative decoding "
        f"({vllm_config.speculative_config.method!r}) on the V1 runner"
    )
