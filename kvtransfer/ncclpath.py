"""The ``nccl`` data path: KV blocks between GPUs over the 2-rank communicators of ``nccl``.

The sender is rank 0 and mints the communicator's unique id (carried in the authenticated
``hello``), the receiver rank 1; a ``data`` frame announces what the grouped
ncclSend/ncclRecv that follow it move.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.kvtransfer.nccl import (
    NCCL_IN_PROGRESS,
    NCCL_UNIQUE_ID_BYTES,
    CommRegistry,
    NcclLibrary,
    wait_ready,
)
from pdserve.kvtransfer.states import FailureCause, TransferError


def block_pointers(cache: Any, layer: int, blocks: Sequence[int]) -> list[int]:
    """Device addresses of ``cache[layer, b]`` (contiguous runs of ``block_nbytes``)."""
    base = cache[layer].data_ptr()
    stride = cache[layer].stride(0) * cache.element_size()
    return [base + b * stride for b in blocks]


def _stream_wait(lib: NcclLibrary, comm: int, event: Any, deadline: float) -> None:
    """Wait for ``event`` while watching the communicator; abort it on error or deadline."""
    while not event.query():
        err = lib.async_error(comm)
        if err not in (0, NCCL_IN_PROGRESS):
            lib.abort(comm)
            lib.check(err, "NCCL transfer")
        if time.monotonic() > deadline:
            lib.abort(comm)
            raise TransferError(FailureCause.TIMEOUT, "NCCL transfer did not finish before the deadline")
        time.sleep(0.0002)


def make_nccl_path(cache: Any, io_timeout_s: float, max_comms: int = 8) -> Any:
    """An ``NcclPath`` for a CUDA cache (imported lazily: CPU-only processes never need it)."""
    import torch

    from pdserve.kvtransfer.channel import Connection
    from pdserve.kvtransfer.datapath import DataPath, data_range
    from pdserve.kvtransfer.directwrite import cuda_marker, order_after
    from pdserve.kvtransfer.heads import HeadSlice
    from pdserve.kvtransfer.slices import Moved, head_bytes, pack, unpack

    class NcclPath(DataPath):
        """Sender is rank 0 and mints the unique id; the receiver is rank 1. The ``data`` frame
        announces a layer's blocks; the bytes then move as grouped ncclSend/ncclRecv. A head
        slice is packed into one staging buffer per layer (one copy per run of blocks), sent as
        one piece, and scattered on the receiver the same way."""

        name = "nccl"
        direct_write = False

        def __init__(self) -> None:
            super().__init__(cache)
            self.lib = NcclLibrary()
            self.device = cache.device
            self.stream = torch.cuda.Stream(device=self.device)
            self.comms = CommRegistry(max_comms, self._create, self.lib.abort)
            self._pending_uid: dict[int, bytes] = {}
            self._heads = head_bytes(cache)

        def _create(self, rank: int, uid: bytes) -> int:
            with torch.cuda.device(self.device):
                comm = self.lib.init_rank(2, uid, rank, blocking=False)
                wait_ready(self.lib, comm, time.monotonic() + io_timeout_s)
            return comm

        def hello_info(self) -> dict[str, Any]:
            uid = self.lib.unique_id()
            self._pending_uid[threading.get_ident()] = uid
            return {"nccl_uid": uid}

        def accept(self, conn: Connection, hello: dict[str, Any]) -> None:
            uid = hello.get("info", {}).get("nccl_uid")
            if not isinstance(uid, bytes) or len(uid) != NCCL_UNIQUE_ID_BYTES:
                raise TransferError(FailureCause.PROTOCOL, "nccl peer sent no unique id")
            conn.nccl_comm = self.comms.open(id(conn), 1, uid)  # type: ignore[attr-defined]

        def attach(self, conn: Connection) -> None:
            uid = self._pending_uid.pop(threading.get_ident())
            conn.nccl_comm = self.comms.open(id(conn), 0, uid)  # type: ignore[attr-defined]

        def detach(self, conn: Connection) -> None:
            self.comms.close(id(conn))

        def _run(
            self,
            conn: Connection,
            op: Callable[[int, int, int, int, int], None],
            ptrs: list[int],
            peer: int,
            nbytes: int | None = None,
        ) -> None:
            """``op`` on each of ``ptrs`` (``nbytes`` each, a block by default), as one group."""
            comm: int = conn.nccl_comm  # type: ignore[attr-defined]
            stream = self.stream.cuda_stream
            size = self.block_nbytes if nbytes is None else nbytes

            def calls() -> None:
                for p in ptrs:
                    op(p, size, peer, comm, stream)

            self.lib.group(calls)
            event = torch.cuda.Event()
            event.record(self.stream)
            _stream_wait(self.lib, comm, event, time.monotonic() + io_timeout_s)

        def computed_marker(self) -> object | None:
            return cuda_marker(self.device)

        def _order_after(self, marker: object | None) -> None:
            order_after(self.stream, marker)

        def push_layer(
            self,
            conn: Connection,
            transfer_id: str,
            layer: int,
            src: Sequence[int],
            dst: Sequence[int],
            done: bool = False,
        ) -> int:
            end: dict[str, Any] = {"done": True} if done else {}
            conn.send("data", id=transfer_id, layer=layer, first=0, count=len(src), **end)
            self._run(conn, self.lib.send, block_pointers(self.cache, layer, src), peer=1)
            return len(src) * self.block_nbytes

        def receive_data(self, conn: Connection, frame: dict[str, Any], dst: Sequence[int]) -> int:
            layer, blocks = data_range(self.num_layers, frame, dst)
            # The receive overwrites blocks the decode engine may have just freed: after its work.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self._run(conn, self.lib.recv, block_pointers(self.cache, layer, blocks), peer=0)
            return len(blocks) * self.block_nbytes

        def _staging(self, blocks: int, count: int) -> Any:
            _, _, kv, block_size, _, head = self._heads.shape
            # Allocated on the copy stream: the caching allocator reuses it only after that
            # stream's work on it (the pack or scatter copies, the send or receive) is done.
            with torch.cuda.stream(self.stream):
                return torch.empty(
                    (blocks, kv, block_size, count, head), dtype=torch.uint8, device=self.device
                )

        def _push_slice_layer(
            self,
            conn: Connection,
            transfer_id: str,
            layer: int,
            src: Sequence[int],
            heads: HeadSlice,
            done: bool,
        ) -> Moved:
            staging = self._staging(len(src), heads.count)
            with torch.cuda.stream(self.stream):  # ordered after the computed marker
                copies = pack(self._heads, staging, layer, src, heads.src_start, torch.Tensor.copy_)
            end: dict[str, Any] = {"done": True} if done else {}
            conn.send("data", id=transfer_id, layer=layer, first=0, count=len(src), heads=heads.count, **end)
            nbytes = staging.numel()
            self._run(conn, self.lib.send, [staging.data_ptr()], peer=1, nbytes=nbytes)
            return Moved(nbytes, copies)

        def receive_slice(
            self, conn: Connection, frame: dict[str, Any], dst: Sequence[int], heads: HeadSlice
        ) -> Moved:
            layer, blocks = data_range(self.num_layers, frame, dst)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            staging = self._staging(len(blocks), heads.count)
            nbytes = staging.numel()
            self._run(conn, self.lib.recv, [staging.data_ptr()], peer=0, nbytes=nbytes)
            with torch.cuda.stream(self.stream):
                copies = unpack(staging, self._heads, layer, blocks, heads.dst_start, torch.Tensor.copy_)
            self.stream.synchronize()  # the heads are in place before the layer counts as received
            return Moved(nbytes, copies)

        def close(self) -> None:
            self.comms.close_all()

    return NcclPath()
