"""Per-step planning: batch description in, ``AttentionPlan`` out.

CONTRACT (shared by every provider and by npu-vllm-bridge; the implementation of
``plan`` is filled in by the attention work, the fields below are fixed):

``plan(cu_seqlens_q, seq_lens, block_tables, slot_mapping, num_decodes, spec, *,
       device=None, provider=None, buffers=None, num_blocks=None) -> AttentionPlan``

- ``cu_seqlens_q``: host ``[num_reqs + 1]`` int (torch CPU tensor, numpy array or
  list), ``cu_seqlens_q[0] == 0``, non-decreasing; request ``i`` owns query tokens
  ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``.
- ``seq_lens``: host ``[num_reqs]`` int, context + new tokens of each request.
- ``block_tables``: ``[num_reqs, max_blocks]`` int (host or device).
- ``slot_mapping``: ``[num_tokens]`` int (host or device); may be longer than
  ``cu_seqlens_q[-1]`` (graph padding); slot ``-1`` is skipped.
- ``num_decodes``: the first ``num_decodes`` requests are decodes (vLLM orders
  decodes first); each has ``1 + spec.num_speculative_tokens`` query tokens.
- ``device``: where device tensors live (default: ``block_tables.device``).
- ``provider``: provider name, or ``None`` to choose by ``device``.
- ``buffers``: ``PlanBuffers`` for fixed-buffer mode (device tensors become
  views of caller-owned buffers at fixed addresses; overflow -> ``ValueError``).
- ``num_blocks``: when given, block ids are range-checked (host tables only).
"""

from __future__ import annotations



from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from npu_attention.spec import AttentionSpec, BatchState

if TYPE_CHECKING:
    from npu_attention.providers.base import AttentionProvider


@dataclass
class AttentionPlan:
    """One step's attention metadata, shared by every layer of that step.

    Host fields are Python lists (what torch_npu's fused ops take as
    ``actual_seq_lengths``); device fields live on ``device``. In fixed-buffer
    mode the device fields are views of ``PlanBuffers`` at fixed addresses.
    """

    spec: AttentionSpec
    state: BatchState
    provider: AttentionProvider
    device: torch.device
    num_reqs: int
    num_decodes: int
    num_decode_tokens: int
    num_actual_tokens: int  # cu_seqlens_q[-1]; slot_mapping may be longer (padding)
    max_query_len: int
    max_seq_len: int
    # host lists
    cu_seqlens_q_host: list[int]  # [num_reqs + 1], starts at 0
    query_lens_host: list[int]  # [num_reqs]
    seq_lens_host: list[int]  # [num_reqs], context + new tokens (Ascend actual_seq_lengths_kv)
    # device tensors
    cu_seqlens_q: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    context_lens: torch.Tensor  # int32 [num_reqs], seq_lens - query_lens
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_slots], -1 = padding
    provider_data: Any = field(default=None, repr=False)

    @property
    def actual_seq_lengths_q(self) -> list[int]:
        """Cumulative query ends without the leading 0 (Ascend TND convention)."""
        return self.cu_seqlens_q_host[1:]

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes
