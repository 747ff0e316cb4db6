"""Small host-side helpers shared by the kernel launchers."""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()
