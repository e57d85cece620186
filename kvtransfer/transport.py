"""``KVTransport``: one per worker, registered with that worker's KV cache tensor.

Typical use (ids are minted by the router and unique across the cluster)::

    # decode worker                                 # prefill worker
    t = KVTransport(cache, secret)                  t = KVTransport(cache, secret)
    addr = t.listen()                               ...
    blocks = pool.allocate(n)
    t.expect(tid, blocks, lease_s=30)   ---addr, tid, blocks via the router--->
                                                    t.send(tid, addr, src_blocks, blocks, layerwise=True)
                                                    ... model computes layer i ...
                                                    t.layer_ready(tid, i)
    t.poll().finished_receiving / .failed           t.poll().finished_sending / .failed

Contract: the transport never allocates or frees blocks. After ``poll`` reports a transfer
(finished or failed), its record may be dropped with ``forget``; the receiver's owner frees the
destination blocks on failure (on success they hold the request's KV), the sender's owner frees
the source blocks on either. Nothing ever pickles: control frames are schema-checked msgpack.

Backends: ``tcp`` (any two hosts, CPU caches), ``shm`` (one host, CPU; the receiver's cache must
come from ``datapath.allocate_shared_kv_cache``), ``cuda_ipc`` (one node, GPU), ``nccl`` (GPUs,
see ``pdserve.kvtransfer.nccl``), ``auto`` (the best one both ends can use, falling back to ``tcp``).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pdserve.kvtransfer.channel import Peering
from pdserve.kvtransfer.config import TransportConfig
from pdserve.kvtransfer.datapath import DataPath, TcpPath
from pdserve.kvtransfer.directwrite import CudaIpcPath, ShmPath
from pdserve.kvtransfer.heads import HeadSlice
from pdserve.kvtransfer.ncclpath import make_nccl_path
from pdserve.kvtransfer.receiver import Receiver
from pdserve.kvtransfer.sender import Sender
from pdserve.kvtransfer.states import CompletionQueue, Completions, TransferState, TransferStats
from pdserve.kvtransfer.tls import InternalTls
from pdserve.model_runtime.kv_cache.tensors import KVLayout

log = logging.getLogger(__name__)


def layout_of(cache: torch.Tensor) -> dict[str, Any]:
    """The fingerprint both ends must share, as plain values for the handshake."""
    return dataclasses.asdict(KVLayout.of_cache(cache))


def _is_local(address: str) -> bool:
    host = address.rpartition(":")[0]
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return (
            host.startswith("127.")
            or host == "::1"
            or host in socket.gethostbyname_ex(socket.gethostname())[2]
        )
    except OSError:
        return False


class KVTransport:
    def __init__(
        self,
        cache: torch.Tensor,
        secret: bytes,
        config: TransportConfig | None = None,
        shm_path: Path | None = None,
        tls: InternalTls | None = None,
    ) -> None:
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the shared secret must be at least 16 bytes")
        self.config = config = config or TransportConfig()
        self.cache = cache
        self.layout = layout_of(cache)
        self.stats = TransferStats()
        self._completions = CompletionQueue()
        self._paths: dict[str, DataPath] = {}
        if cache.is_cuda:
            self._paths["cuda_ipc"] = CudaIpcPath(cache)
            try:
                self._paths["nccl"] = make_nccl_path(cache, config.io_timeout_s)
            except (OSError, FileNotFoundError) as e:
                log.warning("nccl backend unavailable: %s", e)
        else:
            self._paths["tcp"] = TcpPath(cache)
            self._paths["shm"] = ShmPath(cache, shm_path)
        if config.backend != "auto" and config.backend not in self._paths:
            raise ValueError(f"backend {config.backend!r} cannot serve a {cache.device.type} KV cache")
        for name in self._paths:
            # Every backend's byte counters exist from the start, at 0: a counter series that
            # appears only with its first transfer loses that transfer's bytes to rate().
            self.stats.sent_by_backend[name] += 0
            self.stats.received_by_backend[name] += 0
            self.stats.descriptors_sent_by_backend[name] += 0
            self.stats.descriptors_received_by_backend[name] += 0
        receiver_paths = dict(self._paths)
        if shm_path is None:
            receiver_paths.pop("shm", None)  # peers cannot map a private cache
        self._peering = Peering(
            self.layout,
            secret,
            config.io_timeout_s,
            config.connect_timeout_s,
            tls,
            handshake_timeout_s=config.handshake_timeout_s,
        )
        self._receiver = Receiver(
            receiver_paths, self._peering, self._completions, self.stats, config.fence_grace_s
        )
        self._senders: dict[str, Sender] = {}
        self._lock = threading.Lock()
        self._reaper_stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="kv-reaper", daemon=True)
        self._reaper.start()

    # -- receiver (decode) side --------------------------------------------------------------
    def listen(self) -> str:
        """Start accepting senders; returns "host:port" to hand to them."""
        return self._receiver.listen(self.config.host, self.config.port)

    @property
    def address(self) -> str:
        return self._receiver.address

    def expect(
        self,
        transfer_id: str,
        dst_blocks: Sequence[int],
        lease_s: float | None = None,
        heads: HeadSlice | None = None,
    ) -> None:
        """Accept one transfer into ``dst_blocks`` (reserved by the caller) within the lease.

        ``heads``: the transfer fills only heads ``[dst_start, dst_start + count)`` of those
        blocks (a tensor-parallel rank's share); a begin whose slice fills other heads, or
        none, is refused. None: whole blocks, from a sender whose cache has our heads."""
        lease = self.config.lease_s if lease_s is None else lease_s
        self._receiver.expect(transfer_id, dst_blocks, lease, heads)

    def wait(self, transfer_id: str, timeout_s: float, layers: int | None = None) -> TransferState | None:
        return self._receiver.wait(transfer_id, timeout_s, layers)

    def layers_received(self, transfer_id: str) -> int:
        return self._receiver.layers_done(transfer_id)

    # -- sender (prefill) side ---------------------------------------------------------------
    @property
    def offers(self) -> list[str]:
        """Backends senders may use to reach this transport (publish them with ``address``)."""
        return sorted(self._receiver.paths)

    def _backend_for(self, peer: str, peer_offers: Sequence[str] | None = None) -> str:
        if self.config.backend != "auto":
            return self.config.backend
        if peer_offers is not None:
            ranked = ["cuda_ipc", "nccl"] if self.cache.is_cuda else ["shm", "tcp"]
            if not _is_local(peer):
                ranked = [b for b in ranked if b not in ("cuda_ipc", "shm")]
            usable = [b for b in ranked if b in peer_offers and b in self._paths]
            if not usable:
                raise ValueError(f"no backend in common with {peer} (it offers {list(peer_offers)})")
            return usable[0]
        if self.cache.is_cuda:
            return "cuda_ipc" if _is_local(peer) or "nccl" not in self._paths else "nccl"
        return "shm" if _is_local(peer) else "tcp"

    def _sender(self, backend: str) -> Sender:
        with self._lock:
            s = self._senders.get(backend)
            if s is None:
                s = Sender(self._paths[backend], backend, self._peering, self._completions, self.stats)
                self._senders[backend] = s
            return s

    def send(
        self,
        transfer_id: str,
        peer: str,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        layerwise: bool = False,
        timeout_s: float | None = None,
        peer_offers: Sequence[str] | None = None,
        heads: HeadSlice | None = None,
    ) -> None:
        """Queue a push of ``src_blocks`` into the peer's ``dst_blocks``; returns at once.

        With ``layerwise`` nothing moves until ``layer_ready`` says which layers are computed.
        ``peer_offers`` (the receiver's ``offers``) lets ``auto`` pick a backend it accepts.
        ``heads``: move only heads ``[src_start, src_start + count)`` of each block, into heads
        ``[dst_start, dst_start + count)`` of the peer's (caches of different head counts, as
        tensor-parallel ranks have, need one; ``pdserve.model_runtime.parallel.reshard``).
        Call this and ``layer_ready`` on the thread that computed the blocks: GPU paths order
        their copies after that thread's stream (``DataPath.computed_marker``).
        """
        b = self._backend_for(peer, peer_offers)
        self._sender(b).send(
            transfer_id,
            peer,
            src_blocks,
            dst_blocks,
            layerwise,
            self.config.send_timeout_s if timeout_s is None else timeout_s,
            heads,
        )

    def layer_ready(self, transfer_id: str, layer: int) -> None:
        for s in list(self._senders.values()):
            s.layer_ready(transfer_id, layer)

    # -- both --------------------------------------------------------------------------------
    def cancel(self, transfer_id: str) -> None:
        self._receiver.cancel(transfer_id)
        for s in list(self._senders.values()):
            s.cancel(transfer_id)

    def state(self, transfer_id: str) -> TransferState | None:
        st = self._receiver.state(transfer_id)
        for s in list(self._senders.values()):
            st = st or s.state(transfer_id)
        return st

    def poll(self) -> Completions:
        """Completions since the last poll (never blocks)."""
        return self._completions.drain()

    def on_completion(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a transport thread; keep it cheap) whenever ``poll`` would
        return something new."""
        self._completions.listeners.append(callback)

    def forget(self, transfer_id: str) -> None:
        self._receiver.forget(transfer_id)
        for s in list(self._senders.values()):
            s.forget(transfer_id)

    def num_records(self) -> int:
        """Transfer records held on both sides; 0 once every transfer was reported and
        ``forget`` was called for it (the owners' per-request state check reads it)."""
        return self._receiver.num_records() + sum(s.num_records() for s in list(self._senders.values()))

    def _reap_loop(self) -> None:
        while not self._reaper_stop.wait(0.05):
            try:
                self._receiver.reap()
                for s in list(self._senders.values()):
                    s.reap()
            except Exception:  # keep enforcing deadlines whatever one pass hit
                log.exception("kv transfer reaper pass failed")

    def close(self) -> None:
        self._reaper_stop.set()
        self._reaper.join(timeout=2.0)
        for s in list(self._senders.values()):
            s.close()
        self._receiver.close()
        for p in self._paths.values():
            p.close()

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
