"""The direct-write paths: the sender copies into the receiver's mapped cache, then says so.

``shm`` (same host, CPU: the cache lives in a ``/dev/shm`` file, ``shmfile``) and ``cuda_ipc``
(same node, GPU: a CUDA IPC handle of the cache's storage); see ``datapath`` for the contract
they share with the socket paths.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.kvtransfer.channel import Connection
from pdserve.kvtransfer.copier import BlockCopier
from pdserve.kvtransfer.datapath import DataPath, _block_bytes
from pdserve.kvtransfer.heads import HeadSlice, heads_of
from pdserve.kvtransfer.shmfile import SHM_DIR, SHM_NAME, map_shared
from pdserve.kvtransfer.slices import Moved, coalesce, direct_pairs, head_bytes, slice_block_nbytes
from pdserve.kvtransfer.states import FailureCause, TransferError
from pdserve.model_runtime.kv_cache.tensors import BLOCK_MAJOR, block_major_view, storage_order


class _DirectWritePath(DataPath):
    """Shared logic of the paths whose sender writes into the receiver's cache."""

    direct_write = True

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__(cache)
        self._peers: dict[int, torch.Tensor] = {}  # mapped peer caches, [layers, blocks, bytes]
        self._peer_caches: dict[int, torch.Tensor] = {}  # the same, as caches (6-D)

    @abstractmethod
    def _map_peer(self, info: dict[str, Any], shape: tuple[int, ...]) -> torch.Tensor:
        """The peer's cache of ``shape``, mapped (in our storage order: the handshake compared)."""

    @abstractmethod
    def _copy_slice(
        self, conn: Connection, layers: range, src: Sequence[int], dst: Sequence[int], heads: HeadSlice
    ) -> int:
        """``_copy`` for a head slice; returns the copies issued (``slices.direct_pairs``)."""

    @abstractmethod
    def _copy(self, conn: Connection, layers: range, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy blocks ``src`` of ``layers`` into the peer's ``dst``; the bytes are in place (or
        ordered on the path's stream) when it returns."""

    def attach(self, conn: Connection) -> None:
        shape = peer_shape(self.cache, conn.info)
        peer = self._map_peer(conn.info, shape)
        if tuple(peer.shape) != shape or peer.dtype != self.cache.dtype:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, f"peer cache {tuple(peer.shape)} {peer.dtype}")
        self._peers[id(conn)] = peer.view(peer.shape[0], peer.shape[1], -1)
        self._peer_caches[id(conn)] = peer

    def detach(self, conn: Connection) -> None:
        self._peers.pop(id(conn), None)
        self._peer_caches.pop(id(conn), None)

    def close(self) -> None:
        self._peers.clear()  # drop mappings of peers' caches
        self._peer_caches.clear()

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
        self._announce(conn, transfer_id, layers, last)
        return len(layers) * len(src) * self.block_nbytes

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
        self._order_after(after)
        descriptors = self._copy_slice(conn, layers, src, dst, heads)
        self._announce(conn, transfer_id, layers, last)
        return Moved(len(layers) * len(src) * slice_block_nbytes(self.cache, heads.count), descriptors)

    def _announce(self, conn: Connection, transfer_id: str, layers: range, last: bool) -> None:
        self._written(conn)
        end: dict[str, Any] = {"done": True} if last else {}
        conn.send("layer", id=transfer_id, layer=layers.start, count=len(layers), **end)

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


def peer_shape(cache: torch.Tensor, info: dict[str, Any]) -> tuple[int, ...]:
    """The shape of a direct-write receiver's cache from its ``welcome`` info: ours but for its
    block and head counts (the handshake compared the rest). A receiver that does not say has
    ours (it predates head slices and required identical layouts)."""
    layers, _, kv, block_size, _, head_dim = cache.shape
    if "layout" not in info and "num_blocks" not in info:
        return tuple(cache.shape)
    n_heads, n_blocks = heads_of(info.get("layout")), info.get("num_blocks")
    if n_heads is None or isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 1:
        raise TransferError(FailureCause.PROTOCOL, "peer describes its cache incompletely")
    return (layers, n_blocks, kv, block_size, n_heads, head_dim)


def strides_like(cache: torch.Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a cache of ``shape`` stored in ``cache``'s order."""
    if tuple(shape) == tuple(cache.shape):
        return tuple(cache.stride())
    flat = torch.empty(math.prod(shape), device="meta")
    view = block_major_view(flat, shape) if storage_order(cache) == BLOCK_MAJOR else flat.view(*shape)
    return tuple(view.stride())


def mostly_consecutive(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """The runs of ``coalesce`` when there are few enough that one copy per run beats one per
    block (at most 2, or a quarter of the blocks); else None."""
    runs = coalesce(src, dst)
    return runs if len(runs) * 4 <= len(src) or len(runs) <= 2 else None


class ShmPath(_DirectWritePath):
    """Copies with a few plain threads (``copier``), not torch: see ``pdserve.kvtransfer.copier``."""

    name = "shm"

    def __init__(self, cache: torch.Tensor, shm_path: Path | None, copy_threads: int | None = None) -> None:
        super().__init__(cache)
        if cache.device.type != "cpu":
            raise TransferError(FailureCause.LAYOUT_MISMATCH, "the shm backend needs a CPU KV cache")
        self.shm_path = shm_path
        self._local_np = _block_bytes(cache).numpy()  # [layers, blocks, bytes], shares memory
        self._local_heads = head_bytes(cache).numpy()
        self._peers_np: dict[int, np.ndarray] = {}
        self._peer_heads: dict[int, np.ndarray] = {}
        self._copier = BlockCopier(copy_threads)

    def attach(self, conn: Connection) -> None:
        super().attach(conn)
        self._peers_np[id(conn)] = _block_bytes(self._peers[id(conn)]).numpy()
        self._peer_heads[id(conn)] = head_bytes(self._peer_caches[id(conn)]).numpy()

    def detach(self, conn: Connection) -> None:
        super().detach(conn)
        self._peers_np.pop(id(conn), None)
        self._peer_heads.pop(id(conn), None)

    def _copy_slice(
        self, conn: Connection, layers: range, src: Sequence[int], dst: Sequence[int], heads: HeadSlice
    ) -> int:
        pairs = direct_pairs(self._local_heads, self._peer_heads[id(conn)], layers, src, dst, heads)
        self._copier.copy(pairs)
        return len(pairs)

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

    def _map_peer(self, info: dict[str, Any], shape: tuple[int, ...]) -> torch.Tensor:
        path, numel = info.get("shm_path"), info.get("numel")
        if not isinstance(path, str) or not isinstance(numel, int) or not SHM_NAME.match(Path(path).name):
            raise TransferError(FailureCause.PROTOCOL, "peer offers no shared-memory KV cache")
        if Path(path).parent != SHM_DIR or numel != math.prod(shape):
            raise TransferError(FailureCause.LAYOUT_MISMATCH, f"peer cache file {path} has {numel} elements")
        try:
            peer = map_shared(path, numel, self.cache.dtype)
        except OSError as e:
            raise TransferError(FailureCause.UNREACHABLE, f"cannot map {path}: {e}") from None
        # The peer's order is ours (the handshake compared layouts): map it in that order.
        return peer.as_strided(shape, strides_like(self.cache, shape))

    def close(self) -> None:
        super().close()
        self._peers_np.clear()
        self._peer_heads.clear()
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
        self._local_heads = head_bytes(cache)
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

    def _copy_slice(
        self, conn: Connection, layers: range, src: Sequence[int], dst: Sequence[int], heads: HeadSlice
    ) -> int:
        """One strided copy per layer and run, all in one launch list."""
        peer = head_bytes(self._peer_caches[id(conn)])
        pairs = direct_pairs(self._local_heads, peer, layers, src, dst, heads)
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        return len(pairs)

    def receiver_info(self) -> dict[str, Any]:
        storage = self.cache.untyped_storage()
        # (device, handle, size, offset, refcount handle/offset, event...); unannotated in torch
        handle = storage._share_cuda_()  # type: ignore[no-untyped-call]
        return {
            "ipc": [h if isinstance(h, (bytes, int, bool)) else bytes(h) for h in handle],
            "offset": self.cache.storage_offset(),
        }

    def _map_peer(self, info: dict[str, Any], shape: tuple[int, ...]) -> torch.Tensor:
        ipc = info.get("ipc")
        if not isinstance(ipc, list) or not all(isinstance(h, (bytes, int, bool)) for h in ipc):
            raise TransferError(FailureCause.PROTOCOL, "peer offers no CUDA IPC handle")
        with torch.cuda.device(self.cache.device):
            storage = torch.UntypedStorage._new_shared_cuda(*ipc)
        offset, stride = int(info.get("offset", 0)), strides_like(self.cache, shape)
        # Elements the view reaches: past the storage, a copy would write another allocation.
        reach = offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
        if reach * self.cache.element_size() > storage.nbytes():
            raise TransferError(FailureCause.LAYOUT_MISMATCH, f"peer cache {shape} exceeds its storage")
        peer = torch.empty(0, dtype=self.cache.dtype, device=self.cache.device)
        peer.set_(storage, offset, shape, stride)
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
        order_after(self._stream, after)  # as in push_layers: before entering the copy stream
        with torch.cuda.stream(self._stream):
            return super().push_slice_layers(conn, transfer_id, layers, src, dst, heads, last=last)

    def _written(self, conn: Connection) -> None:
        self._stream.synchronize()  # the bytes are in the peer's memory before we say so
