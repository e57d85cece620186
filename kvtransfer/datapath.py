"""How bytes move once a connection is up: TCP streams, or direct writes into the peer's memory.

* ``tcp``: the sender writes a ``data`` frame and the layer's blocks as one scatter-gather
  ``sendmsg``; the receiver ``recvmsg_into``s straight into its destination blocks. The receiver
  decides where bytes land, so a late or rogue sender cannot touch other blocks.
* ``shm`` (same host, CPU) and ``cuda_ipc`` (same node, GPU): the receiver's KV cache lives in
  memory the sender can map (a ``/dev/shm`` file, a CUDA IPC handle, both sent over the
  authenticated channel; ``directwrite``); the sender copies each layer's blocks into the destination blocks
  itself and then says so with a ``layer`` frame: one memcpy, no staging. Because the sender
  writes, the receiver releases an accepted transfer only once the sender has confirmed it
  stopped (``aborted``) or its connection is gone.

Layout: ``cache[layer, block]`` is one block of one layer, contiguous; caches are stored
block-major (``pdserve.model_runtime.kv_cache.tensors``), so ``cache[:, block]``, a block's every layer,
is one contiguous piece as well and a whole transfer copies one piece per block.

Head slices (``kvtransfer.heads``): a transfer between caches that hold different KV heads moves
only a slice of each block's heads, one strided copy per layer and run of blocks
(``kvtransfer.slices``); ``push_slice_layers`` and ``receive_slice`` are that path, the whole-block
methods stay as they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pdserve.kvtransfer.channel import Connection
from pdserve.kvtransfer.heads import HeadSlice
from pdserve.kvtransfer.shmfile import SHM_DIR as SHM_DIR
from pdserve.kvtransfer.shmfile import _pid_namespace as _pid_namespace
from pdserve.kvtransfer.shmfile import allocate_shared_kv_cache as allocate_shared_kv_cache
from pdserve.kvtransfer.shmfile import sweep_stale_caches as sweep_stale_caches
from pdserve.kvtransfer.slices import Moved, head_bytes, pack, slice_block_nbytes, unpack
from pdserve.kvtransfer.states import FailureCause, TransferError


def _block_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 [layers, blocks, bytes per block]."""
    return cache.view(cache.shape[0], cache.shape[1], -1).view(torch.uint8)


class DataPath(ABC):
    name: str
    direct_write: bool

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.num_layers = cache.shape[0]
        self.num_heads = cache.shape[4]
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

    def push_slice_layers(
        self,
        conn: Connection,
        transfer_id: str,
        layers: range,
        src: Sequence[int],
        dst: Sequence[int],
        heads: HeadSlice,
        after: object | None = None,
        last: bool = False,
    ) -> Moved:
        """``push_layers`` for a sliced transfer: only ``heads`` of each block move. Socket paths
        send one ``data`` frame per layer (``_push_slice_layer``)."""
        self._order_after(after)
        moved = [
            self._push_slice_layer(conn, transfer_id, layer, src, heads, last and layer == layers.stop - 1)
            for layer in layers
        ]
        return Moved(sum(m.nbytes for m in moved), sum(m.descriptors for m in moved))

    def _push_slice_layer(
        self, conn: Connection, transfer_id: str, layer: int, src: Sequence[int], heads: HeadSlice, done: bool
    ) -> Moved:
        raise TransferError(FailureCause.REJECTED, f"{self.name} does not move head slices")

    def receive_slice(
        self, conn: Connection, frame: dict[str, Any], dst: Sequence[int], heads: HeadSlice
    ) -> Moved:
        """``receive_data`` for a sliced transfer: the payload holds ``heads`` of each block."""
        raise TransferError(FailureCause.PROTOCOL, f"{self.name} does not carry data frames")

    def payload_nbytes(self, frame: dict[str, Any]) -> int:
        """Bytes that follow a ``data`` frame: whole blocks, or its ``heads`` of each."""
        per_block = slice_block_nbytes(self.cache, frame["heads"]) if "heads" in frame else self.block_nbytes
        return int(frame["count"]) * per_block

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
        self._heads = head_bytes(cache).numpy()  # [layers, blocks, 2, block, heads, bytes per head]

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
        layer, blocks = data_range(self.num_layers, frame, dst)
        arr = self._arr[layer]
        conn.recv_into([memoryview(arr[b]) for b in blocks])
        return len(blocks) * self.block_nbytes

    def _covers_cache(self, count: int) -> bool:
        """A slice of every head this cache holds: on this side it is whole blocks, which go
        out of (or into) the cache as they are, with no staging copy; only the other side,
        whose cache holds more heads, slices."""
        return count == self.cache.shape[4]

    def _push_slice_layer(
        self, conn: Connection, transfer_id: str, layer: int, src: Sequence[int], heads: HeadSlice, done: bool
    ) -> Moved:
        end: dict[str, Any] = {"done": True} if done else {}
        fields: dict[str, Any] = dict(id=transfer_id, layer=layer, first=0, count=len(src), heads=heads.count)
        if self._covers_cache(heads.count):
            conn.send("data", [self._arr[layer][b] for b in src], **fields, **end)
            return Moved(len(src) * self.block_nbytes, 0)
        staging = self._staging(len(src), heads.count)
        descriptors = pack(self._heads, staging, layer, src, heads.src_start, np.copyto)
        conn.send("data", [staging], **fields, **end)
        return Moved(staging.nbytes, descriptors)

    def receive_slice(
        self, conn: Connection, frame: dict[str, Any], dst: Sequence[int], heads: HeadSlice
    ) -> Moved:
        layer, blocks = data_range(self.num_layers, frame, dst)
        if self._covers_cache(heads.count):
            arr = self._arr[layer]
            conn.recv_into([memoryview(arr[b]) for b in blocks])
            return Moved(len(blocks) * self.block_nbytes, 0)
        staging = self._staging(len(blocks), heads.count)
        conn.recv_into([staging.data])
        return Moved(staging.nbytes, unpack(staging, self._heads, layer, blocks, heads.dst_start, np.copyto))

    def _staging(self, blocks: int, count: int) -> np.ndarray:
        _, _, kv, block_size, _, head = self._heads.shape
        return np.empty((blocks, kv, block_size, count, head), dtype=np.uint8)

    def discard_data(self, conn: Connection, frame: dict[str, Any]) -> None:
        conn.drain(self.payload_nbytes(frame))


def data_range(num_layers: int, frame: dict[str, Any], dst: Sequence[int]) -> tuple[int, Sequence[int]]:
    """The layer and destination blocks a ``data`` frame fills, checked against the transfer."""
    layer: int = frame["layer"]
    first: int = frame["first"]
    count: int = frame["count"]
    if layer >= num_layers or first + count > len(dst):
        raise TransferError(FailureCause.PROTOCOL, f"data frame out of range: {frame}")
    return layer, dst[first : first + count]
