"""How bytes move once a connection is up: TCP streams, or direct writes into the peer's memory.

* ``tcp``: the sender writes a ``data`` frame and the layer's blocks as one scatter-gather
  ``sendmsg``; the receiver ``recvmsg_into``s straight into its destination blocks. The receiver
  decides where bytes land, so a late or rogue sender cannot touch other blocks.
* ``shm`` (same host, CPU) and ``cuda_ipc`` (same node, GPU): the receiver's KV cache lives in
  memory the sender can map (a ``/dev/shm`` file, a CUDA IPC handle, both sent over the
  authenticated channel); the sender copies each layer's blocks into the destination blocks
  itself and then says so with a ``layer`` frame: one memcpy, no staging. Because the sender
  writes, the receiver releases an accepted transfer only once the sender has confirmed it
  stopped (``aborted``) or its connection is gone.

Layout: ``cache[layer, block]`` is one block of one layer, contiguous; caches are stored
block-major (``pdserve.model_runtime.kv_cache.tensors``), so ``cache[:, block]``, a block's every layer,
is one contiguous piece as well and a whole transfer copies one piece per block.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.kvtransfer.channel import Connection
from pdserve.kvtransfer.copier import BlockCopier
from pdserve.kvtransfer.states import FailureCause, TransferError
from pdserve.model_runtime.kv_cache.tensors import block_major_view

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# pdserve-kv-<pid namespace>-<pid>-<random>: the creator, so a stale file can be told from a live one.
_SHM_NAME = re.compile(r"^pdserve-kv-(\d+)-(\d+)-[0-9a-f]{16}$")


def _block_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 [layers, blocks, bytes per block]."""
    return cache.view(cache.shape[0], cache.shape[1], -1).view(torch.uint8)


class DataPath(ABC):
    name: str
    direct_write: bool

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.num_layers = cache.shape[0]
        self.block_nbytes = cache[0, 0].numel() * cache.element_size()

    def receiver_info(self) -> dict[str, Any]:
        return {}

    def hello_info(self) -> dict[str, Any]:
        """Sender side: what the ``hello`` carries for this path (e.g. an NCCL unique id)."""
        return {}

    def accept(self, conn: Connection, hello: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Receiver side, after the handshake (e.g. join the NCCL communicator)."""

    def attach(self, conn: Connection) -> None:  # noqa: B027 (optional hook)
        """Sender side, after the handshake: prepare to write to that peer."""

    def detach(self, conn: Connection) -> None:  # noqa: B027 (optional hook)
        """Sender side: the connection is gone."""

    @abstractmethod
    def push_layer(
        self,
        conn: Connection,
        transfer_id: str,
        layer: int,
        src: Sequence[int],
        dst: Sequence[int],
        done: bool = False,
    ) -> int:
        """Move one layer's blocks; returns bytes moved. The caller holds the transfer's lock.
        ``done``: the frame announcing them also ends the transfer."""

    def push_layers(
        self,
        conn: Connection,
        transfer_id: str,
        layers: range,
        src: Sequence[int],
        dst: Sequence[int],
        after: object | None = None,
        last: bool = False,
    ) -> int:
        """Move several computed layers (the caller holds the transfer's lock). ``after``: the
        ``computed_marker`` taken when the last of them was reported computed; ``last``: they
        are the transfer's final layers, and their final frame ends it (one frame, not two)."""
        self._order_after(after)
        return sum(
            self.push_layer(conn, transfer_id, layer, src, dst, done=last and layer == layers.stop - 1)
            for layer in layers
        )

    def computed_marker(self) -> object | None:
        """Called on the thread that computes the cache, once the layers it reports are written
        there: what a copy made later, on another thread, must be ordered after. On a GPU that
        is an event on the computing thread's stream — not the sender thread's, which knows
        nothing of a side stream the engine (or a CUDA graph) runs on — and copies wait for it on
        the device, so a layer's copy overlaps the next layer's compute. None on a CPU, where
        the computation is finished when it is reported."""
        return None

    def _order_after(self, marker: object | None) -> None:  # noqa: B027 (optional hook)
        """Make this path's next copies wait for ``marker`` (a GPU path's stream wait)."""

    def receive_data(self, conn: Connection, frame: dict[str, Any], dst: Sequence[int]) -> int:
        raise TransferError(FailureCause.PROTOCOL, f"{self.name} does not carry data frames")

    def discard_data(self, conn: Connection, frame: dict[str, Any]) -> None:
        """Consume the payload of a ``data`` frame nobody wants, keeping the stream in step."""
        raise TransferError(FailureCause.PROTOCOL, f"{self.name} does not carry data frames")

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the path holds (mappings, files)."""


class TcpPath(DataPath):
    name = "tcp"
    direct_write = False

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__(cache)
        if cache.device.type != "cpu":
            raise TransferError(FailureCause.LAYOUT_MISMATCH, "the tcp backend needs a CPU KV cache")
        self._arr = _block_bytes(cache).numpy()  # shares memory with the cache

    def push_layer(
        self,
        conn: Connection,
        transfer_id: str,
        layer: int,
        src: Sequence[int],
        dst: Sequence[int],
        done: bool = False,
    ) -> int:
        arr = self._arr[layer]
        end: dict[str, Any] = {"done": True} if done else {}
        conn.send("data", [arr[b] for b in src], id=transfer_id, layer=layer, first=0, count=len(src), **end)
        return len(src) * self.block_nbytes

    def receive_data(self, conn: Connection, frame: dict[str, Any], dst: Sequence[int]) -> int:
        layer: int = frame["layer"]
        first: int = frame["first"]
        count: int = frame["count"]
        if layer >= self.num_layers or first + count > len(dst):
            raise TransferError(FailureCause.PROTOCOL, f"data frame out of range: {frame}")
        arr = self._arr[layer]
        conn.recv_into([memoryview(arr[b]) for b in dst[first : first + count]])
        return count * self.block_nbytes

    def discard_data(self, conn: Connection, frame: dict[str, Any]) -> None:
        conn.drain(frame["count"] * self.block_nbytes)


class _DirectWritePath(DataPath):
    """Shared logic of the paths whose sender writes into the receiver's cache."""

    direct_write = True

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__(cache)
        self._peers: dict[int, torch.Tensor] = {}  # mapped peer caches, [layers, blocks, bytes]

    @abstractmethod
    def _map_peer(self, info: dict[str, Any]) -> torch.Tensor: ...

    @abstractmethod
    def _copy(self, conn: Connection, layers: range, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy blocks ``src`` of ``layers`` into the peer's ``dst``; the bytes are in place (or
        ordered on the path's stream) when it returns."""

    def attach(self, conn: Connection) -> None:
        peer = self._map_peer(conn.info)
        if peer.shape != self.cache.shape or peer.dtype != self.cache.dtype:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, f"peer cache {tuple(peer.shape)} {peer.dtype}")
        self._peers[id(conn)] = peer.view(peer.shape[0], peer.shape[1], -1)

    def detach(self, conn: Connection) -> None:
        self._peers.pop(id(conn), None)

    def close(self) -> None:
        self._peers.clear()  # drop mappings of peers' caches

    def push_layer(
        self,
        conn: Connection,
        transfer_id: str,
        layer: int,
        src: Sequence[int],
        dst: Sequence[int],
        done: bool = False,
    ) -> int:
        return self.push_layers(conn, transfer_id, range(layer, layer + 1), src, dst, last=done)

    def push_layers(
        self,
        conn: Connection,
        transfer_id: str,
        layers: range,
        src: Sequence[int],
        dst: Sequence[int],
        after: object | None = None,
        last: bool = False,
    ) -> int:
        self._order_after(after)
        self._copy(conn, layers, src, dst)
        self._written(conn)
        end: dict[str, Any] = {"done": True} if last else {}
        conn.send("layer", id=transfer_id, layer=layers.start, count=len(layers), **end)
        return len(layers) * len(src) * self.block_nbytes

    def _written(self, conn: Connection) -> None:
        """Make the copies visible to the peer before announcing them (a device sync on GPUs)."""


def cuda_marker(device: torch.device) -> torch.cuda.Event:
    """An event recorded on the calling thread's current stream of ``device``."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def order_after(stream: torch.cuda.Stream, marker: object | None) -> None:
    """``stream``'s next work waits for ``marker`` (an event), or, with none, for everything on
    the calling thread's current stream (the order a caller that took no marker can give)."""
    if isinstance(marker, torch.cuda.Event):
        stream.wait_event(marker)
    else:
        stream.wait_stream(torch.cuda.current_stream(stream.device))


def mostly_consecutive(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """The runs of ``coalesce`` when there are few enough that one copy per run beats one per
    block (at most 2, or a quarter of the blocks); else None."""
    runs = coalesce(src, dst)
    return runs if len(runs) * 4 <= len(src) or len(runs) <= 2 else None


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs where both block lists advance by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _map_shared(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
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
        m = _SHM_NAME.match(path.name)
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
        return block_major_view(_map_shared(str(path), numel, dtype), shape), path
    except BaseException:
        path.unlink(missing_ok=True)
        raise


class ShmPath(_DirectWritePath):
    """Copies with a few plain threads (``copier``), not torch: see ``pdserve.kvtransfer.copier``."""

    name = "shm"

    def __init__(self, cache: torch.Tensor, shm_path: Path | None, copy_threads: int | None = None) -> None:
        super().__init__(cache)
        if cache.device.type != "cpu":
            raise TransferError(FailureCause.LAYOUT_MISMATCH, "the shm backend needs a CPU KV cache")
        self.shm_path = shm_path
        self._local_np = _block_bytes(cache).numpy()  # [layers, blocks, bytes], shares memory
        self._peers_np: dict[int, np.ndarray] = {}
        self._copier = BlockCopier(copy_threads)

    def attach(self, conn: Connection) -> None:
        super().attach(conn)
        self._peers_np[id(conn)] = _block_bytes(self._peers[id(conn)]).numpy()

    def detach(self, conn: Connection) -> None:
        super().detach(conn)
        self._peers_np.pop(id(conn), None)

    def _copy(self, conn: Connection, layers: range, src: Sequence[int], dst: Sequence[int]) -> None:
        peer = self._peers_np[id(conn)][layers.start : layers.stop]
        local = self._local_np[layers.start : layers.stop]
        runs = mostly_consecutive(src, dst)
        if runs is not None:
            self._copier.copy([(peer[:, d : d + n], local[:, s : s + n]) for s, d, n in runs])
        else:  # a block's layers: one contiguous piece when all are sent (block-major storage)
            self._copier.copy([(peer[:, d], local[:, s]) for s, d in zip(src, dst, strict=True)])

    def receiver_info(self) -> dict[str, Any]:
        if self.shm_path is None:
            return {}
        return {"shm_path": str(self.shm_path), "numel": self.cache.numel()}

    def _map_peer(self, info: dict[str, Any]) -> torch.Tensor:
        path, numel = info.get("shm_path"), info.get("numel")
        if not isinstance(path, str) or not isinstance(numel, int) or not _SHM_NAME.match(Path(path).name):
            raise TransferError(FailureCause.PROTOCOL, "peer offers no shared-memory KV cache")
        if Path(path).parent != SHM_DIR or numel != self.cache.numel():
            raise TransferError(FailureCause.LAYOUT_MISMATCH, f"peer cache file {path} has {numel} elements")
        try:
            peer = _map_shared(path, numel, self.cache.dtype)
        except OSError as e:
            raise TransferError(FailureCause.UNREACHABLE, f"cannot map {path}: {e}") from None
        # The peer's order is ours (the handshake compared layouts): map it with our strides.
        return peer.as_strided(self.cache.shape, self.cache.stride())

    def close(self) -> None:
        super().close()
        self._peers_np.clear()
        self._copier.close()
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)
            self.shm_path = None


class CudaIpcPath(_DirectWritePath):
    """Same-node GPU transfer through a CUDA IPC handle of the receiver's cache storage."""

    name = "cuda_ipc"

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__(cache)
        if not cache.is_cuda:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, "the cuda_ipc backend needs a CUDA KV cache")
        self._stream = torch.cuda.Stream(device=cache.device)
        self._local = cache.view(cache.shape[0], cache.shape[1], -1)  # [layers, blocks, bytes]
        self._local_blocks = self._local.unbind(1)  # every layer of one block, per block
        self._peer_blocks: dict[int, tuple[torch.Tensor, ...]] = {}

    def attach(self, conn: Connection) -> None:
        super().attach(conn)
        self._peer_blocks[id(conn)] = self._peers[id(conn)].unbind(1)

    def detach(self, conn: Connection) -> None:
        super().detach(conn)
        self._peer_blocks.pop(id(conn), None)

    def close(self) -> None:
        super().close()
        self._peer_blocks.clear()

    def _copy(self, conn: Connection, layers: range, src: Sequence[int], dst: Sequence[int]) -> None:
        """All layers of a block per operation; one slice per run when mostly consecutive."""
        runs = mostly_consecutive(src, dst)
        peer = self._peers[id(conn)][layers.start : layers.stop]
        local = self._local[layers.start : layers.stop]
        if runs is not None:
            for s, d, n in runs:
                peer[:, d : d + n].copy_(local[:, s : s + n])
        elif len(layers) == self.num_layers:  # scattered, whole: one strided copy per block
            pb, lb = self._peer_blocks[id(conn)], self._local_blocks
            torch._foreach_copy_([pb[d] for d in dst], [lb[s] for s in src])
        else:  # scattered, some layers
            torch._foreach_copy_([peer[:, d] for d in dst], [local[:, s] for s in src])

    def receiver_info(self) -> dict[str, Any]:
        storage = self.cache.untyped_storage()
        # (device, handle, size, offset, refcount handle/offset, event...); unannotated in torch
        handle = storage._share_cuda_()  # type: ignore[no-untyped-call]
        return {
            "ipc": [h if isinstance(h, (bytes, int, bool)) else bytes(h) for h in handle],
            "offset": self.cache.storage_offset(),
        }

    def _map_peer(self, info: dict[str, Any]) -> torch.Tensor:
        ipc = info.get("ipc")
        if not isinstance(ipc, list) or not all(isinstance(h, (bytes, int, bool)) for h in ipc):
            raise TransferError(FailureCause.PROTOCOL, "peer offers no CUDA IPC handle")
        with torch.cuda.device(self.cache.device):
            storage = torch.UntypedStorage._new_shared_cuda(*ipc)
        peer = torch.empty(0, dtype=self.cache.dtype, device=self.cache.device)
        peer.set_(storage, int(info.get("offset", 0)), self.cache.shape, self.cache.stride())
        return peer

    def computed_marker(self) -> object | None:
        return cuda_marker(self.cache.device)

    def push_layers(
        self,
        conn: Connection,
        transfer_id: str,
        layers: range,
        src: Sequence[int],
        dst: Sequence[int],
        after: object | None = None,
        last: bool = False,
    ) -> int:
        # Ordered before entering the copy stream: without a marker, "everything on the caller's
        # current stream" must name the caller's stream, not the copy stream itself.
        order_after(self._stream, after)
        with torch.cuda.stream(self._stream):
            return super().push_layers(conn, transfer_id, layers, src, dst, last=last)

    def _written(self, conn: Connection) -> None:
        self._stream.synchronize()  # the bytes are in the peer's memory before we say so
