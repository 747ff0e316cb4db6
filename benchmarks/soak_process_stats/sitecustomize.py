"""Loaded by every Python process of the soak's server (``soak_server.py`` puts this
directory first on ``PYTHONPATH``): a daemon thread writes, every
``SOAK_PROCESS_STATS_EVERY`` seconds, this process's memory as the C allocator and
Python see it to ``$SOAK_PROCESS_STATS_DIR/<process name>-<pid>.json``:

* ``rss_anon`` / ``rss_file``: resident anonymous and file-backed bytes (``/proc``);
* ``malloc_heap``: bytes glibc's arenas hold (``mallinfo2().arena``), of which
  ``malloc_used`` are allocated and ``malloc_free`` free but kept; ``malloc_mmap``: bytes
  of blocks glibc mapped on their own (returned to the system when freed);
* ``py_blocks``: memory blocks Python's own allocator has handed out
  (``sys.getallocatedblocks``; not ``gc.get_objects``, whose list would hold a tuple
  another thread is still building, which then fails to resize: ``SystemError``).

Forked children (vLLM's engine core and workers) start their own thread. Does nothing
without ``SOAK_PROCESS_STATS_DIR``; off glibc the ``malloc_*`` fields are absent.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time

DIR = os.environ.get("SOAK_PROCESS_STATS_DIR")
EVERY = float(os.environ.get("SOAK_PROCESS_STATS_EVERY", "10"))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _malloc() -> dict[str, int]:
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {
        "malloc_heap": info.arena,
        "malloc_used": info.uordblks,
        "malloc_free": info.fordblks,
        "malloc_mmap": info.hblkhd,
    }


def _proc() -> dict[str, int]:
    fields = {"RssAnon:": "rss_anon", "RssFile:": "rss_file"}
    with open("/proc/self/status") as status:
        found = {fields[p[0]]: int(p[1]) * 1024 for p in map(str.split, status) if p[0] in fields}
    with open("/proc/self/comm") as comm:
        return {"name": comm.read().strip(), **found}


def _write() -> None:
    stats = {**_proc(), **_malloc(), "py_blocks": sys.getallocatedblocks(), "at": time.time()}
    path = os.path.join(DIR, f"{stats['name']}-{os.getpid()}.json".replace("/", "_"))
    with open(path + ".tmp", "w") as out:
        json.dump(stats, out)
    os.replace(path + ".tmp", path)


def _loop() -> None:
    while True:
        try:
            _write()
        except OSError:  # the directory is gone: the soak is over
            return
        time.sleep(EVERY)


def _start() -> None:
    threading.Thread(target=_loop, name="soak-process-stats", daemon=True).start()


if DIR:
    os.makedirs(DIR, exist_ok=True)
    os.register_at_fork(after_in_child=_start)
    _start()
