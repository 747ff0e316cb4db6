"""Small host-side helpers shared by the kernel launchers."""

from __future__ import annotations

import functools
import os

import torch


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=16)
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; CPU cores elsewhere (the
    interpreter), so that occupancy rules still give a count."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


@functools.lru_cache(maxsize=32)
def nvmma_shared_layout(rows: int, cols: int, dtype):
    """Gluon's default swizzled shared-memory layout of a ``[rows, cols]`` tile of
    ``dtype`` (what TMA copies and the MMAs read); needs Triton with Gluon."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)
