"""Caller-owned, fixed-capacity device buffers for the step state (fixed-buffer mode)."""

from __future__ import annotations

import numpy as np
import torch

from npu_attention._inputs import HostArrays, copy_into, host_staging
from npu_attention.spec import AttentionSpec


class PlanBuffers:
    """Device buffers that ``plan(..., buffers=...)`` writes each step's state into.

    Every plan made with the same buffers exposes views that start at the same
    addresses, so a captured graph keeps reading the current step's state. The
    capacity is fixed at allocation; a larger batch raises ``ValueError``.

    Beyond the step's own entries the buffers hold neutral padding, so a graph
    captured for a larger batch reads empty requests: ``cu_seqlens_q`` repeats
    its last value, ``seq_lens`` and ``context_lens`` are 0, ``slot_mapping`` is
    -1, and block-table columns past the step's width are 0.

    Not used by the vLLM bridge today (it hands ``plan`` vLLM's own device lengths as
    ``device_lengths`` and refreshes captured step state through npu-graphs' updatable
    tasks); for engines that capture device graphs over step state they do not already
    keep at fixed addresses.

    Attributes:
        meta: int32 ``[3 * max_num_reqs + 1]``: ``cu_seqlens_q | seq_lens | context_lens``.
        block_tables: int32 ``[max_num_reqs, max_blocks_per_req]``.
        slot_mapping: int64 ``[max_num_tokens]``.
    """

    def __init__(self, meta: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor):
        max_num_reqs = block_tables.shape[0]
        if meta.shape != (3 * max_num_reqs + 1,) or meta.dtype != torch.int32:
            raise ValueError(
                f"meta must be int32 [{3 * max_num_reqs + 1}], got {meta.dtype} {tuple(meta.shape)}"
            )
        if block_tables.dtype != torch.int32 or slot_mapping.dtype != torch.int64:
            raise TypeError(
                "block_tables must be int32 and slot_mapping int64, got "
                f"{block_tables.dtype} and {slot_mapping.dtype}"
            )
        if not meta.device == block_tables.device == slot_mapping.device:
            raise ValueError(
                f"buffers must share one device, got {meta.device}, "
                f"{block_tables.device}, {slot_mapping.device}"
            )
        self.meta = meta
        self.block_tables = block_tables
        self.slot_mapping = slot_mapping
        # How far earlier steps may have written (block-table columns, slots): padding is
        # restored only where a smaller step leaves stale entries behind. Buffers given by
        # the caller may hold anything, buffers from ``allocate`` start neutral.
        self._dirty_columns = self.max_blocks_per_req
        self._dirty_slots = self.max_num_tokens
        self._views: dict[tuple[int, int, int], tuple[tuple[torch.Tensor, ...], ...]] = {}

    @classmethod
    def allocate(
        cls,
        max_num_reqs: int,
        max_num_tokens: int,
        max_blocks_per_req: int,
        device: torch.device | str = "cpu",
    ) -> PlanBuffers:
        """Allocate buffers for up to ``max_num_reqs`` requests, ``max_num_tokens``
        slots and ``max_blocks_per_req`` blocks per request on ``device``."""
        for name, value in (
            ("max_num_reqs", max_num_reqs),
            ("max_num_tokens", max_num_tokens),
            ("max_blocks_per_req", max_blocks_per_req),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        device = torch.device(device)
        meta = torch.zeros(3 * max_num_reqs + 1, dtype=torch.int32, device=device)
        tables = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32, device=device)
        slots = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        buffers = cls(meta, tables, slots)
        buffers._dirty_columns = buffers._dirty_slots = 0
        return buffers

    @property
    def max_num_reqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def max_blocks_per_req(self) -> int:
        return self.block_tables.shape[1]

    @property
    def device(self) -> torch.device:
        return self.meta.device

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """int32 ``[max_num_reqs + 1]`` (full capacity)."""
        return self.meta[: self.max_num_reqs + 1]

    @property
    def seq_lens(self) -> torch.Tensor:
        """int32 ``[max_num_reqs]`` (full capacity)."""
        return self.meta[self.max_num_reqs + 1 : 2 * self.max_num_reqs + 1]

    @property
    def context_lens(self) -> torch.Tensor:
        """int32 ``[max_num_reqs]`` (full capacity)."""
        return self.meta[2 * self.max_num_reqs + 1 :]

    def load(
        self,
        host: HostArrays,
        tables: torch.Tensor,
        slots: torch.Tensor,
        device: torch.device,
        spec: AttentionSpec,
    ) -> tuple[torch.Tensor, ...]:
        """Write one step's state; return views ``(cu_seqlens_q, seq_lens, context_lens,
        block_tables, slot_mapping)`` sized to the step.

        Raises:
            ValueError: the step does not fit, or ``device`` is not the buffers' device.
        """
        num_reqs, width = len(host.seq_lens), self._width(host, tables, spec)
        num_slots = slots.shape[0]
        self._check_fits(device, num_reqs, num_slots)
        tables_dst, slots_dst, views = self._step_views(num_reqs, width, num_slots)
        staged = host_staging(self.meta.shape, torch.int32, device)
        self._pack_meta(host, staged.numpy())
        self.meta.copy_(staged, non_blocking=True)
        if width:
            copy_into(tables_dst, tables[:, :width] if tables.shape[1] != width else tables)
        if self._dirty_columns > width:  # every row: later, larger steps read them too
            self.block_tables[:, width : self._dirty_columns].zero_()
        self._dirty_columns = width
        if num_slots:
            copy_into(slots_dst, slots)
        if self._dirty_slots > num_slots:
            self.slot_mapping[num_slots : self._dirty_slots].fill_(-1)
        self._dirty_slots = num_slots
        return views

    def _step_views(
        self, num_reqs: int, width: int, num_slots: int
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Copy destinations and the plan's views for a step of this size (cached: slicing
        costs host time, and the views of one size are the same every step)."""
        key = (num_reqs, width, num_slots)
        cached = self._views.get(key)
        if cached is None:
            if len(self._views) >= 256:
                self._views.clear()
            cap = self.max_num_reqs
            cached = self._views[key] = (
                self.block_tables[:num_reqs, :width],
                self.slot_mapping[:num_slots],
                (
                    self.meta[: num_reqs + 1],
                    self.meta[cap + 1 : cap + 1 + num_reqs],
                    self.meta[2 * cap + 1 : 2 * cap + 1 + num_reqs],
                    self.block_tables[:num_reqs],
                    self.slot_mapping[:num_slots],
                ),
            )
        return cached

    def _width(self, host: HostArrays, tables: torch.Tensor, spec: AttentionSpec) -> int:
        """Block-table columns to copy: all of them, or as many as the longest sequence
        needs when the table is wider than the buffer."""
        if tables.shape[1] <= self.max_blocks_per_req:
            return tables.shape[1]
        needed = -(-int(host.seq_lens.max(initial=0)) // spec.block_size)
        if needed > self.max_blocks_per_req:
            raise ValueError(
                f"PlanBuffers hold {self.max_blocks_per_req} blocks per request, "
                f"the step needs {needed}"
            )
        return self.max_blocks_per_req

    def _check_fits(self, device: torch.device, num_reqs: int, num_slots: int) -> None:
        if device != self.device:
            raise ValueError(f"PlanBuffers live on {self.device}, the plan is for {device}")
        if num_reqs > self.max_num_reqs:
            raise ValueError(
                f"PlanBuffers hold {self.max_num_reqs} requests, the step has {num_reqs}"
            )
        if num_slots > self.max_num_tokens:
            raise ValueError(
                f"PlanBuffers hold {self.max_num_tokens} slots, the step has {num_slots}"
            )

    def _pack_meta(self, host: HostArrays, packed: np.ndarray) -> None:
        """Write ``cu_seqlens_q | seq_lens | context_lens`` with neutral padding into ``packed``."""
        num_reqs, cap = len(host.seq_lens), self.max_num_reqs
        packed[: num_reqs + 1] = host.cu_seqlens_q
        packed[num_reqs + 1 : cap + 1] = host.cu_seqlens_q[-1]
        packed[cap + 1 : cap + 1 + num_reqs] = host.seq_lens
        packed[cap + 1 + num_reqs : 2 * cap + 1] = 0
        packed[2 * cap + 1 : 2 * cap + 1 + num_reqs] = host.context_lens
        packed[2 * cap + 1 + num_reqs :] = 0
