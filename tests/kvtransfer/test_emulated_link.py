"""``EmulatedLink``: receive completions wait out the emulated link's time, the poller is woken
when they are due, a cancel releases a held one at once, and nothing is left after ``forget``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from pdserve.kvtransfer.emulated_link import EmulatedLink
from pdserve.kvtransfer.states import Completions


class FakeTransport:
    """Receives whatever ``arrive`` says, at once."""

    def __init__(self) -> None:
        self.done = Completions()
        self.records: set[str] = set()
        self.listeners: list[Callable[[], None]] = []
        self.cancelled: list[str] = []

    def expect(self, transfer_id: str, dst_blocks: Sequence[int], lease_s: float | None = None) -> None:
        self.records.add(transfer_id)

    def arrive(self, transfer_id: str) -> None:
        self.done.finished_receiving.add(transfer_id)
        for cb in self.listeners:
            cb()

    def poll(self) -> Completions:
        done, self.done = self.done, Completions()
        return done

    def cancel(self, transfer_id: str) -> None:
        self.cancelled.append(transfer_id)

    def forget(self, transfer_id: str) -> None:
        self.records.discard(transfer_id)

    def num_records(self) -> int:
        return len(self.records)

    def on_completion(self, callback: Callable[[], None]) -> None:
        self.listeners.append(callback)

    def close(self) -> None:
        pass


def test_receives_wait_out_the_link_time_and_wake_the_poller() -> None:
    inner = FakeTransport()
    link = EmulatedLink(inner, lambda tokens: tokens * 1e-3, block_size=16)  # 16 ms a block
    woken = threading.Event()
    link.on_completion(woken.set)
    try:
        link.expect("t1", [0, 1, 2])  # 48 tokens: 48 ms
        inner.arrive("t1")
        t0 = time.monotonic()
        assert link.poll().finished_receiving == set()  # arrived, but the link is still busy
        woken.clear()
        assert woken.wait(1.0)
        while not (done := link.poll()).finished_receiving:
            assert time.monotonic() - t0 < 1.0
            time.sleep(0.001)
        assert done.finished_receiving == {"t1"} and time.monotonic() - t0 >= 0.047
        assert link.num_records() == 2  # the inner record and the link's, until forget
        link.forget("t1")
        assert link.num_records() == 0
    finally:
        link.close()


def test_a_cancel_releases_a_held_transfer_at_once() -> None:
    inner = FakeTransport()
    link = EmulatedLink(inner, lambda tokens: 60.0, block_size=16)
    try:
        link.expect("t2", [5])
        inner.arrive("t2")
        assert not link.poll()
        link.cancel("t2")
        assert inner.cancelled == ["t2"]
        assert link.poll().finished_receiving == {"t2"}  # as the real transport reported it
        link.forget("t2")
        assert link.num_records() == 0
        assert link.poll().finished_receiving == set()
    finally:
        link.close()
