"""What every part of `moe-bench chaos` shares: the layer it serves, its progress log, and
process probes (psutil: None for a process that is gone)."""
from __future__ import annotations

import os
import sys
import time
from typing import Optional



D_MODEL, D_FF, N_EXPERTS, TOP_K = 64, 128, 8, 2
MAX_BATCH = 256


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- process probes (psutil: None for a process that is gone) -----------------------------------
def proc(pid: int, what):
    import psutil

    try:
        return what(psutil.Process(pid))
    except psutil.Error:
        return None


def rss_kb(pid: int) -> Optional[int]:
    return proc(pid, lambda p: p.memory_info().rss // 1024)


def fds(pid: int) -> Optional[int]:
    return proc(pid, lambda p: p.num_fds())


def dev_shm() -> list:
    try:
        return sorted(os.listdir("/dev/shm"))
    except OSError:
        return []


def children(pid: int) -> list[int]:
    return proc(pid, lambda p: [c.pid for c in p.children()]) or []
