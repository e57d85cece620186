"""The ``/dev/shm`` files that hold CPU KV caches a same-host peer can map (``shm`` backend):
creating them, mapping a peer's, and sweeping the files of workers that died."""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

import torch

from pdserve.kvtransfer.states import FailureCause, TransferError
from pdserve.model_runtime.kv_cache.tensors import block_major_view

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# pdserve-kv-<pid namespace>-<pid>-<random>: the creator, so a stale file can be told from a live one.
SHM_NAME = re.compile(r"^pdserve-kv-(\d+)-(\d+)-[0-9a-f]{16}$")


def map_shared(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Map a cache file shared and pre-faulted (MAP_POPULATE): transfers never page-fault."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != nbytes:
            raise TransferError(
                FailureCause.LAYOUT_MISMATCH, f"{path} holds {os.fstat(fd).st_size} bytes, expected {nbytes}"
            )
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=dtype, count=numel)  # keeps ``mm`` alive


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep_stale_caches(directory: Path = SHM_DIR) -> list[Path]:
    """Remove the cache files of workers that died without removing them (a SIGKILL, a crash):
    those created in this PID namespace by a process that no longer exists. Files of other
    namespaces (other containers sharing the directory) are left alone: their PIDs mean nothing
    here. Returns what was removed."""
    ns = _pid_namespace()
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        m = SHM_NAME.match(path.name)
        if m is None or int(m.group(1)) != ns or _alive(int(m.group(2))):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:  # another sweeper was first, or it is not ours to remove
            continue
    return removed


def allocate_shared_kv_cache(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, Path]:
    """A zeroed block-major CPU cache (``pdserve.model_runtime.kv_cache.tensors``) backed by a fresh
    ``/dev/shm`` file (mode 0600) that peers can map. Stale files of dead workers go first, so
    killed workers do not fill ``/dev/shm`` over time."""
    stale = sweep_stale_caches()
    if stale:
        log.info("removed %d KV cache files of dead workers from %s", len(stale), SHM_DIR)
    path = SHM_DIR / f"pdserve-kv-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"
    numel = math.prod(shape)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.ftruncate(fd, numel * torch.empty(0, dtype=dtype).element_size())
        finally:
            os.close(fd)
        return block_major_view(map_shared(str(path), numel, dtype), shape), path
    except BaseException:
        path.unlink(missing_ok=True)
        raise
