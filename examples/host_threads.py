"""OpenMP threads for vLLM's CPU worker when it runs inside the engine's own process."""

from __future__ import annotations

import os


def set_default_omp_threads() -> int:
    """Set ``OMP_NUM_THREADS``, when unset, to the usable cores less one (at least 1).

    Call it before torch is imported; returns the value in force. With
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` vLLM's CPU worker shares the engine's process
    and keeps torch's default of one thread per core: its OpenMP threads spin between
    ops while the engine's Python code runs, and one other busy process on the machine
    stalls every parallel region (on a 2-core machine, 16 decode steps of SmolLM2 took
    from 1.3 s to 27 s with 2 threads, 2.2 s to 2.4 s with 1). vLLM's multiprocess CPU
    executor keeps one core for the engine the same way
    (``VLLM_CPU_OMP_THREADS_BIND=auto``).
    """
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        os.environ["OMP_NUM_THREADS"] = str(max(1, (cores or 1) - 1))
    return int(os.environ["OMP_NUM_THREADS"])
