"""A live worker's prefix-cache events on its channel: the first batch carries a snapshot, every
later one what its cache stored and evicted, so two routers' indexes — one that heard the
channel from the start, one that joined later from a snapshot — both end up holding exactly the
keys the worker's pool caches."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pdserve.decode_worker.actor import DecodeWorker
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.router.prefix import PrefixIndex, block_keys
from pdserve.worker.codec import LENGTH
from pdserve.worker.command_codec import decode_from_worker, encode_command
from pdserve.worker.commands import AddLocal
from pdserve.worker.messages import KvEvents, OutputBatch, WorkerRole, WorkItem
from pdserve.worker.spec import WorkerSpec

from .test_command_channel import ENGINE, SECRET, TCP, FakeRouter


class Reader:
    """Reads the worker's frames on a thread: every batch's events, in order, for the routers
    listening from a given frame on."""

    def __init__(self, router: FakeRouter) -> None:
        self.router = router
        self.lock = threading.Lock()
        self.events: list[KvEvents | None] = []  # one entry a batch
        self.views: list[tuple[PrefixIndex, int]] = []  # (index, first batch it hears)
        self.finished: set[str] = set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn = self.router.conn
        assert conn is not None
        try:
            while True:
                frame = decode_from_worker(self.router._read(conn), "d0")
                if isinstance(frame, OutputBatch):
                    with self.lock:
                        self.finished.update(d.request_id for d in frame.deltas if d.finished)
                        self.events.append(frame.kv)
                        for view, start in self.views:
                            if start <= len(self.events) - 1 and frame.kv is not None:
                                view.apply("d0", frame.kv)
        except (OSError, ConnectionError):
            return

    def wait_finished(self, ids: set[str]) -> bool:
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            with self.lock:
                if ids <= self.finished:
                    return True
            time.sleep(0.02)
        return False

    def listen(self, view: PrefixIndex, snapshot: Callable[[], KvEvents] | None = None) -> None:
        """``view`` hears every batch from now on, after a snapshot (taken now) or, without one,
        every batch so far."""
        with self.lock:
            if snapshot is not None:
                view.apply("d0", snapshot())
            else:
                for kv in self.events:
                    if kv is not None:
                        view.apply("d0", kv)
            self.views.append((view, len(self.events)))


def add_local(router: FakeRouter, call_id: int, prompt: tuple[int, ...]) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    router.send_raw(encode_command(call_id, AddLocal(WorkItem(f"r{call_id}", prompt, params)))[LENGTH.size :])


def test_routers_from_the_start_and_from_a_snapshot_agree_with_the_pool() -> None:
    router = FakeRouter()
    spec = WorkerSpec("d0", WorkerRole.DECODE, ENGINE, TCP, SECRET, router_address=router.address)
    worker = DecodeWorker(spec)
    try:
        assert router.accept() == "d0"
        reader = Reader(router)

        def truth() -> set[bytes]:
            return set(worker.loop.call(lambda: worker.engine.kv.pool.cached_keys()))

        def settled(*views: PrefixIndex) -> bool:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                held = truth()
                with reader.lock:
                    if all(v.holds("d0") == held for v in views):
                        return True
                time.sleep(0.1)
            return False

        deadline = time.monotonic() + 5.0
        while not reader.events and time.monotonic() < deadline:
            time.sleep(0.01)
        first = reader.events[0]
        assert first is not None and first.snapshot == ()  # a new connection starts from a snapshot
        early = PrefixIndex(ENGINE.cache.block_size, hint_s=0.0)
        reader.listen(early)
        shared = tuple(range(1, 41))  # 5 blocks of 8 tokens
        for i in range(2):
            add_local(router, i + 1, shared + tuple(range(100 + 10 * i, 108 + 10 * i)))
        assert reader.wait_finished({"r1", "r2"}) and settled(early)
        assert early.cached_blocks("d0", block_keys(shared, 8), now=0.0) == 5

        late = PrefixIndex(ENGINE.cache.block_size, hint_s=0.0)  # a router that joins now
        reader.listen(late, worker.loop.kv_snapshot)
        assert late.holds("d0") == truth() != set()  # knows the cached blocks at once
        for i in range(10):  # distinct prompts: 10 x 8 blocks do not fit in 64
            add_local(router, 10 + i, (i + 1,) * 64)  # (the model's 259 token ids)
        assert reader.wait_finished({f"r{10 + i}" for i in range(10)})
        assert worker.loop.call(lambda: worker.engine.kv.pool.num_evictions) > 0
        assert settled(early, late)
    finally:
        worker.shutdown()
        router.close()
