"""Process-level settings that make CPU inference fast: the allocator, applied once by the
engine, and the torch threads, set by each process from its CPU allotment.

glibc serves allocations above its mmap threshold with a fresh ``mmap`` and returns them with
``munmap`` on free, so every large temporary (an activation of a 2,048-token prefill is 8-32 MB)
page-faults on first touch, every layer, every step: measured here, a fused SiLU-and-multiply
of 16 MB took 9-55 ms instead of 1.4 ms. Raising the threshold to glibc's maximum (32 MB) and
keeping freed memory in the heap removes those faults.

Torch's default takes a thread for every core of the host for each operation; on a host whose
cores are busy (other workers, the router, another deployment), those threads wait on each
other at every operation: ``pdserve generate`` took 34-42 s for 32 tokens on a busy 2-core host
with torch's default, 0.8-1.9 s with one thread. A process sizes its threads from the CPUs it
is given instead (``use_threads``): a worker from its placement's CPUs (Ray's ``num_cpus``,
``--cpus-per-worker``), a command from its ``--threads``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit
_done = False


def tune_malloc() -> bool:
    """Apply the allocator settings (Linux glibc only; ``PDSERVE_NO_MALLOC_TUNING=1`` skips)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or os.environ.get("PDSERVE_NO_MALLOC_TUNING"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(
        mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX),
            (_M_TRIM_THRESHOLD, 1 << 30),
            (_M_TOP_PAD, 64 << 20),
        )
    )
    _done = ok
    if not ok:
        log.debug("mallopt refused the allocator settings")
    return ok


def cpu_allotment() -> int:
    """CPUs this process may run on: its CPU affinity, capped by its cgroup's CPU quota (a
    container's limit), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpus()
    return max(1, min(cpus, quota) if quota is not None else cpus)


def _cgroup_cpus(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """Whole CPUs of the cgroup (v2) quota, rounded up; None without one."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, -(-int(quota) // int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def use_threads(n: int) -> int:
    """Torch's intra-op threads to ``n`` (0: the process's ``cpu_allotment``) and its inter-op
    pool to one thread (pdserve runs no inter-op parallel work; the pool can only be sized before
    its first use); returns the intra-op count."""
    import torch

    n = n if n > 0 else cpu_allotment()
    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # already sized, or already used: it stays as it is
        torch.set_num_interop_threads(1)
    return n
