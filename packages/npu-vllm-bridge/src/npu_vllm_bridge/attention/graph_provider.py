"""A host provider whose decode steps keep one op sequence and one set of shapes.

A host graph (npu-graphs' ``host`` backend) replays recorded aten ops; an attention
task re-issued with a new step must produce the same ops with the same shapes, as a
re-issued NPU task must. npu-attention's ``reference`` provider sizes its decode
tile by the step's longest sequence and skips padding slots by compaction, so its
shapes follow the data. This provider runs decode-only steps on the full width of
the block table (fixed per padded batch) with visibility as a mask, and writes
padding tokens back over the value they would replace, so both depend only on the
batch size. Other batch states use the ``reference`` kernels unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from npu_attention import BatchState
from npu_attention.providers.reference import ReferenceProvider, masked_attention

if TYPE_CHECKING:
    from npu_attention import AttentionPlan

PROVIDER_NAME = "reference_fixed_decode"


@dataclass(frozen=True)
class FixedDecodeData:
    """Indices of a decode step, shaped by ``(num_reqs, block-table width)`` only."""

    kv_blocks: torch.Tensor  # int64 [b, width * block_size]
    kv_offsets: torch.Tensor  # int64 [b, width * block_size]
    hidden: torch.Tensor  # bool [b, 1, 1, 1, width * block_size], True = not visible
    write_blocks: torch.Tensor  # int64 [b]; padding tokens point at block 0
    write_offsets: torch.Tensor  # int64 [b]
    write_mask: torch.Tensor  # bool [b, 1, 1], False for padding tokens


class FixedShapeDecodeProvider(ReferenceProvider):
    """``reference`` kernels, with fixed-geometry decode steps (see the module doc)."""

    name: ClassVar[str] = PROVIDER_NAME
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)

    def prepare(self, plan: AttentionPlan):
        if plan.state is not BatchState.DECODE_ONLY:
            return super().prepare(plan)
        return _fixed_decode_data(plan)

    def write_kv(self, key, value, key_cache, value_cache, plan: AttentionPlan) -> None:
        data = plan.provider_data
        if not isinstance(data, FixedDecodeData):
            return super().write_kv(key, value, key_cache, value_cache, plan)
        count = data.write_blocks.shape[0]
        for new, cache in ((key[:count], key_cache), (value[:count], value_cache)):
            index = (data.write_blocks, data.write_offsets)
            cache.index_put_(index, torch.where(data.write_mask, new, cache[index]))

    def attend(self, query, key_cache, value_cache, plan: AttentionPlan, out, key=None, value=None):
        data = plan.provider_data
        if not isinstance(data, FixedDecodeData):
            return super().attend(query, key_cache, value_cache, plan, out, key, value)
        count = data.kv_blocks.shape[0]
        rows = masked_attention(
            query[:count].unsqueeze(1),
            key_cache[data.kv_blocks, data.kv_offsets],
            value_cache[data.kv_blocks, data.kv_offsets],
            data.hidden,
            plan.spec.softmax_scale,
            plan.spec.logits_soft_cap,
        )
        out[:count].copy_(rows)
        return None


def _fixed_decode_data(plan: AttentionPlan) -> FixedDecodeData:
    spec = plan.spec
    tables = plan.block_tables.long()
    width = tables.shape[1] * spec.block_size
    positions = torch.arange(width, device=plan.device)[None, :]
    seq_lens = plan.seq_lens.long()[:, None]
    visible = positions < seq_lens
    if spec.sliding_window is not None:
        visible &= positions > seq_lens - 1 - spec.sliding_window
    # Hidden keys read the request's last real key, so every value read is finite.
    key_pos = torch.minimum(positions, (seq_lens - 1).clamp(min=0))
    slots = plan.slot_mapping[: plan.num_reqs]
    real = slots >= 0
    safe = torch.where(real, slots, torch.zeros_like(slots))
    return FixedDecodeData(
        kv_blocks=tables.gather(1, key_pos // spec.block_size),
        kv_offsets=key_pos % spec.block_size,
        hidden=~visible[:, None, None, None, :],
        write_blocks=safe // spec.block_size,
        write_offsets=safe % spec.block_size,
        write_mask=real[:, None, None],
    )


def register() -> None:
    """Make the provider available to ``npu_attention.plan(provider=PROVIDER_NAME)``."""
    from npu_attention import register_provider

    register_provider(PROVIDER_NAME, f"{__name__}:FixedShapeDecodeProvider")
