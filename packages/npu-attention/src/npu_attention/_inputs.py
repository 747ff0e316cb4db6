"""Conversion and validation of ``plan`` inputs (host side, vectorized)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from npu_attention.spec import AttentionSpec


class HostArrays(NamedTuple):
    """The step's host metadata as int64 numpy arrays (what ``prepare`` vectorizes over)."""

    cu_seqlens_q: np.ndarray  # [num_reqs + 1]
    query_lens: np.ndarray  # [num_reqs]
    seq_lens: np.ndarray  # [num_reqs]
    context_lens: np.ndarray  # [num_reqs]


def host_arrays(cu_seqlens_q: Any, seq_lens: Any) -> HostArrays:
    """Checked ``HostArrays`` of a step from its host ``cu_seqlens_q`` and ``seq_lens``."""
    cu = as_host_array(cu_seqlens_q, "cu_seqlens_q")
    seq = as_host_array(seq_lens, "seq_lens")
    query_lens = check_cu_seqlens(cu, seq)
    host = HostArrays(cu, query_lens, seq, seq - query_lens)
    check_seq_lens(host.seq_lens, host.query_lens, host.context_lens)
    return host


def as_host_array(values: Any, name: str) -> np.ndarray:
    """A new 1-D int64 numpy array from a CPU tensor, numpy array or sequence of ints."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be on the host (cpu), got a tensor on {values.device}")
        _check_integer_dtype(values.dtype, name)
        array = values.numpy()
    else:
        array = np.asarray(values)
        if array.size == 0 and array.dtype.kind == "f":
            array = array.astype(np.int64)
        if array.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(array.shape)}")
    return array.astype(np.int64)  # a copy: callers reuse their host buffers every step


def as_int_tensor(values: Any, name: str, ndim: int) -> torch.Tensor:
    """An integer tensor (any device) of ``ndim`` dims from a tensor, array or list."""
    if not isinstance(values, torch.Tensor):
        array = np.asarray(values)
        if array.size == 0 and array.dtype.kind == "f":
            array = array.astype(np.int64)
        if array.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
        if array.size == 0 and ndim == 2 and array.ndim == 1:
            array = array.reshape(0, 0)
        values = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    _check_integer_dtype(values.dtype, name)
    if values.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(values.shape)}")
    return values


def check_cu_seqlens(cu: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Check the offsets; return the query lengths ``cu[1:] - cu[:-1]``."""
    if len(cu) != len(seq_lens) + 1:
        raise ValueError(
            f"cu_seqlens_q must have len(seq_lens) + 1 = {len(seq_lens) + 1} entries, got {len(cu)}"
        )
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {int(cu[0])}")
    steps = cu[1:] - cu[:-1]
    if steps.min(initial=0) < 0:
        i = int(np.argmax(steps < 0))
        raise ValueError(
            f"cu_seqlens_q must be non-decreasing, got cu_seqlens_q[{i}]={int(cu[i])} > "
            f"cu_seqlens_q[{i + 1}]={int(cu[i + 1])}"
        )
    return steps


def check_seq_lens(seq_lens: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray) -> None:
    """Each request's ``seq_lens`` covers its query tokens (``context_lens >= 0``); the
    int32 bound is ``build_plan``'s, which takes the maximum anyway."""
    if context_lens.min(initial=0) < 0:
        i = int(np.argmax(context_lens < 0))
        raise ValueError(
            f"seq_lens[{i}] must be at least the request's query length {int(query_lens[i])}, "
            f"got {int(seq_lens[i])}"
        )


def check_decodes(num_decodes: Any, query_lens: np.ndarray, spec: AttentionSpec) -> int:
    """``num_decodes`` as an int; decodes bring 1 to ``1 + num_speculative_tokens`` tokens."""
    if isinstance(num_decodes, bool) or not isinstance(num_decodes, (int, np.integer)):
        raise TypeError(f"num_decodes must be an int, got {type(num_decodes).__name__}")
    num_decodes = int(num_decodes)
    if not 0 <= num_decodes <= len(query_lens):
        raise ValueError(
            f"num_decodes must be in [0, num_reqs={len(query_lens)}], got {num_decodes}"
        )
    limit = 1 + spec.num_speculative_tokens
    decode_lens = query_lens[:num_decodes]
    if decode_lens.max(initial=0) > limit:
        i = int(np.argmax(decode_lens > limit))
        raise ValueError(
            f"decode requests bring at most 1 + num_speculative_tokens = {limit} query "
            f"tokens, got {int(decode_lens[i])} for request {i}"
        )
    return num_decodes


def resolve_device(device: torch.device | str | None, tables: torch.Tensor) -> torch.device:
    """``device`` (default: the block tables' device), checked to exist here."""
    if device is None:
        device = tables.device
    else:
        try:
            device = torch.device(device)
        except RuntimeError as error:  # a device type torch does not know (no backend loaded)
            raise ValueError(
                f"device {str(device)!r} is not available on this machine ({error})"
            ) from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if is_available is None or not is_available():
        raise ValueError(
            f"device {str(device)!r} is not available on this machine "
            f"(torch.{device.type}.is_available() is false or missing)"
        )
    if device.index is None and hasattr(backend, "current_device"):
        device = torch.device(device.type, backend.current_device())
    return device


def check_device_lengths(
    lengths: Any, num_reqs: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens_q, seq_lens)`` given on the device, checked by their metadata only
    and cut to ``[num_reqs + 1]`` and ``[num_reqs]``."""
    if not isinstance(lengths, (tuple, list)) or len(lengths) != 2:
        raise TypeError(
            f"device_lengths must be a pair (cu_seqlens_q, seq_lens) of tensors, got {lengths!r}"
        )
    checked = []
    for name, tensor, size in zip(("cu_seqlens_q", "seq_lens"), lengths, (num_reqs + 1, num_reqs)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"device_lengths' {name} must be a tensor, got {type(tensor).__name__}")
        if tensor.device != device or tensor.dtype != torch.int32 or tensor.dim() != 1:
            raise ValueError(
                f"device_lengths' {name} must be a 1-D int32 tensor on {device}, got "
                f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
            )
        if tensor.shape[0] < size or (size > 1 and tensor.stride(0) != 1):
            raise ValueError(
                f"device_lengths' {name} must hold at least {size} contiguous entries, got "
                f"shape {tuple(tensor.shape)} with stride {tensor.stride()}"
            )
        checked.append(tensor if tensor.shape[0] == size else tensor[:size])
    return checked[0], checked[1]


def check_table_rows(tables: torch.Tensor, seq_lens: np.ndarray) -> None:
    if tables.shape[0] != len(seq_lens):
        raise ValueError(
            f"block_tables must have one row per request ({len(seq_lens)}), "
            f"got shape {tuple(tables.shape)}"
        )


def check_block_tables(
    tables: torch.Tensor,
    seq_lens: np.ndarray,
    block_size: int,
    num_blocks: int | None,
    max_seq_len: int | None = None,
) -> None:
    check_table_rows(tables, seq_lens)
    capacity = tables.shape[1] * block_size
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max(initial=0))
    if max_seq_len > capacity:
        i = int(np.argmax(seq_lens))
        raise ValueError(
            f"seq_lens[{i}]={int(seq_lens[i])} exceeds its block table: "
            f"{tables.shape[1]} blocks x block_size {block_size} = {capacity} tokens"
        )
    if num_blocks is None or tables.device.type != "cpu" or not seq_lens.size:
        return
    used = np.arange(tables.shape[1]) < -(-seq_lens[:, None] // block_size)
    ids = tables.numpy()[used]
    bad = (ids < 0) | (ids >= num_blocks)
    if bad.any():
        row, col = (int(x[bad.argmax()]) for x in np.nonzero(used))
        raise ValueError(
            f"block id must be in [0, num_blocks={num_blocks}), got "
            f"block_tables[{row}, {col}]={int(tables[row, col])}"
        )


def check_slot_mapping(
    slots: torch.Tensor, num_tokens: int, block_size: int, num_blocks: int | None
) -> None:
    if slots.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping must cover the {num_tokens} query tokens (cu_seqlens_q[-1]), "
            f"got {slots.shape[0]} slots"
        )
    if num_blocks is None or slots.device.type != "cpu" or not slots.numel():
        return
    top = int(slots.max())
    if top >= num_blocks * block_size:
        raise ValueError(
            f"slot must be < num_blocks * block_size = {num_blocks * block_size}, got {top}"
        )


def _check_integer_dtype(dtype: torch.dtype, name: str) -> None:
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {dtype}")


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as ``dtype`` on ``device`` without blocking the host.

    A host tensor bound for an accelerator is staged in pinned memory and copied
    asynchronously, so planning the next step overlaps the device's current work
    (a copy from pageable memory would wait for the device to drain). A tensor
    already there with that dtype is returned as is.
    """
    if tensor.dtype == dtype and tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type != "cpu":
        staged = host_staging(tensor.shape, dtype, device)
        staged.copy_(tensor)
        return staged.to(device, non_blocking=True)
    return tensor.to(device=device, dtype=dtype)


def host_staging(shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized host tensor for data bound for ``device``: pinned when that is an
    accelerator. Torch's pinned-memory cache hands a block out again only after the
    asynchronous copies that read it have finished, so each step can take a new one."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type != "cpu")


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` without blocking the host: a host ``src`` bound for an
    accelerator goes through pinned memory, cast there to ``dst``'s dtype."""
    if src.device.type == "cpu" and dst.device.type != "cpu":
        staged = host_staging(src.shape, dst.dtype, dst.device)
        staged.copy_(src)
        src = staged
    dst.copy_(src, non_blocking=True)
