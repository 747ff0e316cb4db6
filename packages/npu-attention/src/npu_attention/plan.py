"""Per-step planning: batch description in, ``AttentionPlan`` out.

CONTRACT (shared by every provider and by npu-vllm-bridge):

``plan(cu_seqlens_q, seq_lens, block_tables, slot_mapping, num_decodes, spec, *,
       device=None, provider=None, buffers=None, num_blocks=None,
       device_lengths=None, slot_handling="host", null_block=None) -> AttentionPlan``

- ``cu_seqlens_q``: host ``[num_reqs + 1]`` int (torch CPU tensor, numpy array or
  list), ``cu_seqlens_q[0] == 0``, non-decreasing; request ``i`` owns query tokens
  ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``.
- ``seq_lens``: host ``[num_reqs]`` int, context + new tokens of each request.
- ``block_tables``: ``[num_reqs, max_blocks]`` int (host or device); ``None``
  for attention without a KV cache (encoder), then ``run`` takes no caches.
- ``slot_mapping``: ``[num_tokens]`` int (host or device); may be longer than
  ``cu_seqlens_q[-1]`` (graph padding); slot ``-1`` is skipped; ``None`` means
  no token is written (all ``-1``).
- ``num_decodes``: the first ``num_decodes`` requests are decodes (vLLM orders
  decodes first); each has ``1 + spec.num_speculative_tokens`` query tokens.
- ``device``: where device tensors live (default: ``block_tables.device``).
- ``provider``: provider name, or ``None`` to choose by ``device``.
- ``buffers``: ``PlanBuffers`` for fixed-buffer mode (device tensors become
  views of caller-owned buffers at fixed addresses; overflow -> ``ValueError``).
- ``num_blocks``: when given, block ids are range-checked (host tables only).
- ``slot_handling``: how providers that cannot skip a ``-1`` slot inside their KV write
  (``ascend``) treat padding slots. ``"host"`` (default): the slots are read on the host
  (a device ``slot_mapping`` is copied back, which waits for the device) and ``-1`` rows
  are not written, so the write's row count changes with the step: eager steps only.
  ``"device"``: the values are never read on the host; ``-1`` slots are redirected, in
  place in the plan's ``slot_mapping`` (a view of the caller's device tensor when it has
  the plan's device and int64), to rows of block ``null_block``, which holds no request's
  keys, and every token of the step is written: the write keeps its shape and tensors
  from step to step, as a graph task re-issued with new host arguments needs.
- ``null_block``: the block padding rows go to under ``slot_handling="device"`` (vLLM
  keeps block 0 as its null block); required there.
- ``device_lengths``: ``(cu_seqlens_q, seq_lens)`` already on ``device`` (int32,
  stride 1, at least ``[num_reqs + 1]`` and ``[num_reqs]``) holding the host values,
  as a model runner keeps them (vLLM's ``query_start_loc`` and ``seq_lens``): the
  plan's device tensors are views of them and ``plan`` copies no metadata to the
  device. Their values are not read back (that would synchronize); not with
  ``buffers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from npu_attention import _inputs
from npu_attention._inputs import HostArrays
from npu_attention.buffers import PlanBuffers
from npu_attention.registry import get_provider
from npu_attention.spec import AttentionSpec, BatchState, StepSpec


@dataclass
class AttentionPlan:
    """One step's attention metadata, shared by every layer of that step.

    Host fields are Python lists (what torch_npu's fused ops take as
    ``actual_seq_lengths``); device fields live on ``device``. In fixed-buffer
    mode the device fields are views of ``PlanBuffers`` at fixed addresses.
    """

    spec: AttentionSpec  # or an npu_attention.mla.MLASpec
    state: BatchState
    # The chosen provider: an npu_attention.providers.base.AttentionProvider, or an
    # npu_attention.providers.mla_base.MLAProvider for an MLASpec.
    provider: Any
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
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_slots], -1 = padding
    provider_data: Any = field(default=None, repr=False)
    # how padding slots (-1) reach a KV write that cannot skip them (see the module doc)
    slot_handling: str = "host"
    null_block: int | None = None
    # additions to the contract (all derived from the fields above)
    context_lens_host: list[int] = field(default_factory=list)  # [num_reqs]
    max_context_len: int = 0
    has_cache: bool = True  # False: planned with block_tables=None (no KV cache)
    host_arrays: HostArrays | None = field(default=None, repr=False)
    buffers: PlanBuffers | None = field(default=None, repr=False)
    device_context_lens: torch.Tensor | None = field(default=None, repr=False)

    @property
    def context_lens(self) -> torch.Tensor:
        """int32 ``[num_reqs]`` on ``device``: ``seq_lens`` minus the query lengths
        (uploaded with the other lengths, or computed there on first use when the plan
        was given ``device_lengths``)."""
        if self.device_context_lens is None:
            cu = self.cu_seqlens_q
            self.device_context_lens = self.seq_lens - (cu[1:] - cu[:-1])
        return self.device_context_lens

    @property
    def actual_seq_lengths_q(self) -> list[int]:
        """Cumulative query ends without the leading 0 (Ascend TND convention)."""
        return self.cu_seqlens_q_host[1:]

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_actual_tokens - self.num_decode_tokens

    @property
    def has_context(self) -> bool:
        """Whether any request reads keys it did not bring in this step."""
        return self.max_context_len > 0


def plan(
    cu_seqlens_q: Any,
    seq_lens: Any,
    block_tables: Any,
    slot_mapping: Any,
    num_decodes: int,
    spec: AttentionSpec,
    *,
    device: torch.device | str | None = None,
    provider: str | None = None,
    buffers: PlanBuffers | None = None,
    num_blocks: int | None = None,
    device_lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
    slot_handling: str = "host",
    null_block: int | None = None,
) -> AttentionPlan:
    """Turn one step's batch description into an ``AttentionPlan`` (see the module doc).

    All checks run before anything is written (buffers included), so a failed
    call leaves no partial state behind.

    Raises:
        TypeError: non-integer metadata or a ``spec`` that is not an ``AttentionSpec``
            or ``MLASpec``.
        ValueError: inconsistent lengths or offsets, a sequence longer than its
            block table, out-of-range block ids or slots, a device that is not
            available, an unknown provider or one that does not run on ``device``
            or does not take ``spec`` (e.g. its head size),
            a batch larger than ``buffers``, ``device_lengths`` of another device,
            dtype or size (or given with ``buffers``), or a ``slot_handling`` other than
            ``"host"`` / ``"device"`` (``"device"`` without a ``null_block``).
    """
    if not isinstance(spec, StepSpec):
        raise TypeError(f"spec must be an AttentionSpec or an MLASpec, got {type(spec).__name__}")
    host = _inputs.host_arrays(cu_seqlens_q, seq_lens)
    return build_plan(
        host, block_tables, slot_mapping, num_decodes, spec, device, provider, buffers,
        num_blocks, device_lengths, SlotHandling(slot_handling, null_block, num_blocks),
    )  # fmt: skip


def build_plan(
    host: HostArrays,
    block_tables: Any,
    slot_mapping: Any,
    num_decodes: int,
    spec: AttentionSpec,
    device: torch.device | str | None,
    provider: str | None,
    buffers: PlanBuffers | None,
    num_blocks: int | None,
    device_lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
    slot_handling: SlotHandling | None = None,
) -> AttentionPlan:
    """``plan`` from checked host arrays (``npu_attention.context_parallel`` builds
    plans whose ``seq_lens`` count only cached keys through here)."""
    max_query_len = int(host.query_lens.max(initial=0))
    max_seq_len = int(host.seq_lens.max(initial=0))
    if max_seq_len >= 2**31:
        raise ValueError(f"seq_lens must fit in int32, got {max_seq_len}")
    max_context_len = int(host.context_lens.max(initial=0))
    num_decodes = _inputs.check_decodes(num_decodes, host.query_lens, spec)
    tables, slots = _tables_and_slots(
        block_tables, slot_mapping, host, spec, num_blocks, max_seq_len
    )
    device = _resolve_device(device, tables)
    chosen = get_provider(provider, device, family=spec.provider_family)
    chosen.check_spec(spec)
    _check_kv_cache_dtype(chosen, spec)
    cu_t, seq_t, ctx_t, tables_t, slots_t = _device_tensors(
        host, tables, slots, device, spec, buffers, device_lengths
    )
    cu_list = host.cu_seqlens_q.tolist()
    result = AttentionPlan(
        spec=spec,
        state=_classify(max_query_len, max_context_len, num_decodes, len(host.seq_lens)),
        provider=chosen,
        device=device,
        num_reqs=len(host.seq_lens),
        num_decodes=num_decodes,
        num_decode_tokens=cu_list[num_decodes],
        num_actual_tokens=cu_list[-1],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        cu_seqlens_q_host=cu_list,
        query_lens_host=host.query_lens.tolist(),
        seq_lens_host=host.seq_lens.tolist(),
        cu_seqlens_q=cu_t,
        seq_lens=seq_t,
        block_tables=tables_t,
        slot_mapping=slots_t,
        context_lens_host=host.context_lens.tolist(),
        max_context_len=max_context_len,
        has_cache=tables.shape[1] > 0,
        host_arrays=host,
        buffers=buffers,
        device_context_lens=ctx_t,
    )
    if slot_handling is not None:
        result.slot_handling, result.null_block = slot_handling.mode, slot_handling.null_block
    result.provider_data = chosen.prepare(result)
    return result


SLOT_HANDLINGS = ("host", "device")


@dataclass(frozen=True)
class SlotHandling:
    """A checked ``(slot_handling, null_block)`` pair of ``plan`` (see the module doc).

    Raises:
        ValueError: an unknown mode, ``"device"`` without a ``null_block``, or a
            ``null_block`` that is negative or past ``num_blocks``.
    """

    mode: str = "host"
    null_block: int | None = None
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in SLOT_HANDLINGS:
            raise ValueError(f"slot_handling must be one of {SLOT_HANDLINGS}, got {self.mode!r}")
        block = self.null_block
        if block is None:
            if self.mode == "device":
                raise ValueError(
                    'slot_handling="device" redirects padding slots to a null block: pass '
                    "null_block (the id of a block no request uses), got null_block=None"
                )
            return
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError(f"null_block must be an int, got {type(block).__name__}")
        if block < 0 or (self.num_blocks is not None and block >= self.num_blocks):
            raise ValueError(
                f"null_block must be in [0, num_blocks={self.num_blocks}), got {block}"
            )


def _check_kv_cache_dtype(provider: Any, spec: StepSpec) -> None:
    """Raise ``ValueError`` when ``provider`` does not take ``spec.kv_cache_dtype``."""
    kind = getattr(spec, "kv_cache_dtype", "auto")
    accepted = getattr(provider, "kv_cache_dtypes", ("auto",))
    if kind not in accepted:
        raise ValueError(
            f"attention provider {provider.name!r} does not support kv_cache_dtype={kind!r}; "
            f"it takes {list(accepted)}"
        )


def classify(query_lens: np.ndarray, context_lens: np.ndarray, num_decodes: int) -> BatchState:
    """The ``BatchState`` of a batch whose first ``num_decodes`` requests are decodes."""
    return _classify(
        int(query_lens.max(initial=0)),
        int(context_lens.max(initial=0)),
        num_decodes,
        len(query_lens),
    )


def _classify(
    max_query_len: int, max_context_len: int, num_decodes: int, num_reqs: int
) -> BatchState:
    if num_decodes == num_reqs:
        return BatchState.SPEC_DECODING if max_query_len > 1 else BatchState.DECODE_ONLY
    if num_decodes > 0:
        return BatchState.CHUNKED_PREFILL
    if max_context_len > 0:
        return BatchState.PREFILL_CACHE_HIT
    return BatchState.PREFILL_NO_CACHE


# Devices whose availability ``_inputs.resolve_device`` has confirmed: it does not change
# within a process, and asking torch again costs host time every step.
_CHECKED_DEVICES: dict[tuple[Any, torch.device], torch.device] = {}


def _resolve_device(device: torch.device | str | None, tables: torch.Tensor) -> torch.device:
    """``_inputs.resolve_device``, checked once per (``device``, tables' device); an
    accelerator named without an index still follows the backend's current device."""
    key = (device, tables.device)
    resolved = _CHECKED_DEVICES.get(key)
    if resolved is None:
        resolved = _inputs.resolve_device(device, tables)
        if len(_CHECKED_DEVICES) < 64:
            _CHECKED_DEVICES[key] = resolved
        return resolved
    requested = tables.device if device is None else torch.device(device)
    if requested.type == "cpu" or requested.index is not None:
        return resolved
    backend = getattr(torch, requested.type)
    return torch.device(requested.type, backend.current_device())


def _tables_and_slots(
    block_tables: Any,
    slot_mapping: Any,
    host: HostArrays,
    spec: AttentionSpec,
    num_blocks: Any,
    max_seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked integer tensors (on their own device); ``None`` means no cache / no writes."""
    num_tokens = int(host.cu_seqlens_q[-1])
    if block_tables is None:
        block_tables = torch.zeros(len(host.seq_lens), 0, dtype=torch.int32)
    if slot_mapping is None:
        slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
    tables = _inputs.as_int_tensor(block_tables, "block_tables", ndim=2)
    slots = _inputs.as_int_tensor(slot_mapping, "slot_mapping", ndim=1)
    if tables.shape[1]:
        _inputs.check_block_tables(tables, host.seq_lens, spec.block_size, num_blocks, max_seq_len)
    else:
        _inputs.check_table_rows(tables, host.seq_lens)
    _inputs.check_slot_mapping(slots, num_tokens, spec.block_size, num_blocks)
    return tables, slots


def _device_tensors(
    host: HostArrays,
    tables: torch.Tensor,
    slots: torch.Tensor,
    device: torch.device,
    spec: AttentionSpec,
    buffers: PlanBuffers | None,
    device_lengths: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor | None, ...]:
    """``(cu_seqlens_q, seq_lens, context_lens, block_tables, slot_mapping)`` on
    ``device``: views of the caller's ``device_lengths`` (no ``context_lens``: the plan
    derives it on first use), of ``buffers``, or of one fresh upload."""
    if device_lengths is None:
        if buffers is None:
            return _to_device(host, tables, slots, device)
        return buffers.load(host, tables, slots, device, spec)
    if buffers is not None:
        raise ValueError("device_lengths and buffers are exclusive: pass one of them")
    cu_t, seq_t = _inputs.check_device_lengths(device_lengths, len(host.seq_lens), device)
    tables_t = _inputs.to_device(tables, device, torch.int32)
    slots_t = _inputs.to_device(slots, device, torch.int64)
    return cu_t, seq_t, None, tables_t, slots_t


def _to_device(
    host: HostArrays, tables: torch.Tensor, slots: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """One host-to-device copy for the per-request metadata, views into it."""
    num_reqs = len(host.seq_lens)
    staged = _inputs.host_staging(3 * num_reqs + 1, torch.int32, device)
    packed = staged.numpy()
    packed[: num_reqs + 1] = host.cu_seqlens_q
    packed[num_reqs + 1 : 2 * num_reqs + 1] = host.seq_lens
    packed[2 * num_reqs + 1 :] = host.context_lens
    meta = staged if device.type == "cpu" else staged.to(device, non_blocking=True)
    cu_t = meta[: num_reqs + 1]
    seq_t = meta[num_reqs + 1 : 2 * num_reqs + 1]
    ctx_t = meta[2 * num_reqs + 1 :]
    tables_t = _inputs.to_device(tables, device, torch.int32)
    slots_t = _inputs.to_device(slots, device, torch.int64)
    return cu_t, seq_t, ctx_t, tables_t, slots_t
