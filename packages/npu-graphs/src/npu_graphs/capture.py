"""Capture many graphs in one pass: progress bar, timing, and the memory they took."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from npu_graphs.backends import GraphBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureReport:
    """What one capture pass did: keys in capture order, wall time, device memory taken."""

    keys: tuple[Hashable, ...]
    seconds: float
    memory_bytes: int

    def __str__(self) -> str:
        return (
            f"captured {len(self.keys)} graphs in {self.seconds:.2f} s, "
            f"{self.memory_bytes / 2**20:.1f} MiB"
        )


def capture_all(
    keys: Sequence[Hashable],
    capture_one: Callable[[Hashable], object],
    *,
    backend: GraphBackend,
    desc: str = "Capturing graphs",
    progress: bool = True,
) -> CaptureReport:
    """Call ``capture_one(key)`` for each key in the given order, with a tqdm bar.

    Pass keys largest first (``CapturePlan.capture_order()``): smaller graphs then
    reuse memory of the shared pool. The report's memory is the backend's device
    memory in use after the pass minus before it (the graphs' pools and buffers), to
    be counted when sizing the KV cache.
    """
    backend.synchronize()
    before = backend.memory_in_use()
    start = time.perf_counter()
    for key in tqdm(keys, desc=desc, disable=not progress or not keys):
        capture_one(key)
    backend.synchronize()
    report = CaptureReport(
        tuple(keys), time.perf_counter() - start, backend.memory_in_use() - before
    )
    logger.info("%s: %s", desc, report)
    return report
