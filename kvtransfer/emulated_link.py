"""A transport whose receive completions wait out an emulated link's time.

Emulated workers (``compute="emulated:<profile>"``) keep a one-layer stand-in cache, so their
real transport moves a request's KV in microseconds where the emulated GPUs' link would take
``profile.transfer_time(tokens)``. ``EmulatedLink`` wraps the real transport and reports each
finished receive only once that time has passed since the real transfer finished; every other
call goes to the real transport unchanged. The role engines see an ordinary transport: the
emulation lives here, not in them.

Contract: as ``KVTransport``'s. A held transfer that is cancelled is reported at once (as the
real transport reported it: finished); ``num_records`` counts held ones until ``forget``.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.kvtransfer.states import Completions


class EmulatedLink:
    def __init__(self, inner: Any, link_time: Callable[[int], float], block_size: int) -> None:
        """``link_time(tokens)``: the emulated hand-off's seconds for ``tokens`` of KV; a
        transfer carries ``block_size`` tokens per destination block."""
        self.inner = inner
        self.link_time = link_time
        self.block_size = block_size
        self._blocks: dict[str, int] = {}  # expected transfer id -> its destination blocks
        self._held: list[tuple[float, str]] = []  # (ready at, transfer id): received, not reported
        self._released: set[str] = set()  # cancelled while held: report now
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._timer = threading.Thread(target=self._notify_loop, name="kv-link-emulation", daemon=True)
        self._timer.start()

    def __getattr__(self, name: str) -> Any:  # address, offers, stats, listen, send, ...
        return getattr(self.inner, name)

    def expect(self, transfer_id: str, dst_blocks: Sequence[int], lease_s: float | None = None) -> None:
        self.inner.expect(transfer_id, dst_blocks, lease_s)
        with self._lock:
            self._blocks[transfer_id] = len(dst_blocks)

    def poll(self) -> Completions:
        done: Completions = self.inner.poll()
        now = time.monotonic()
        out = Completions(done.finished_sending, set(), done.failed)
        with self._lock:
            for tid in done.finished_receiving:
                tokens = self._blocks.get(tid, 0) * self.block_size
                heapq.heappush(self._held, (now + self.link_time(tokens), tid))
            if done.finished_receiving:
                self._wake.notify()
            while self._held and (self._held[0][0] <= now or self._held[0][1] in self._released):
                _, tid = heapq.heappop(self._held)
                self._released.discard(tid)
                out.finished_receiving.add(tid)
        return out

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            held = any(tid == transfer_id for _, tid in self._held)
            if held:
                self._released.add(transfer_id)
        self.inner.cancel(transfer_id)
        if held:
            self._notify()

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._blocks.pop(transfer_id, None)
        self.inner.forget(transfer_id)

    def num_records(self) -> int:
        with self._lock:
            own = len(self._blocks)
        return int(self.inner.num_records()) + own

    def on_completion(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)
        self.inner.on_completion(callback)

    def _notify(self) -> None:
        for cb in self._listeners:
            cb()

    def _notify_loop(self) -> None:
        """Wake the poller whenever a held transfer becomes ready."""
        fired = float("-inf")  # every transfer ready by then has been announced
        with self._lock:
            while not self._closed:
                upcoming = [t for t, _ in self._held if t > fired]
                if not upcoming:
                    self._wake.wait()
                    continue
                left = min(upcoming) - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                fired = time.monotonic()
                self._lock.release()
                try:
                    self._notify()
                finally:
                    self._lock.acquire()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._timer.join(timeout=1.0)
        self.inner.close()
