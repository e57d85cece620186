"""Runs a role engine on its own thread; other threads talk to it through commands and outputs.

Contract: every engine method runs on the loop thread, between steps, in submission order
(the engines are single-threaded). ``collect`` hands out each delta exactly once, in step
order. If a step raises, the loop stops, ``error`` holds the exception and every later
``submit``/``collect`` raises ``WorkerFailed`` so the router fails this worker's requests
instead of waiting on them. What the engine's prefix cache stores and evicts is logged as it
happens (``take_kv_events``, ``kv_snapshot``: any thread) for the routers' prefix routing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Protocol

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.worker.deltas import coalesce
from pdserve.worker.kv_events import KvEventLog
from pdserve.worker.messages import KvEvents, TokenDelta, WorkerHealth, WorkerLoad, WorkerRole

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5


class WorkerFailed(RuntimeError):
    pass


class RoleEngine(Protocol):
    """What the loop and the host need of a role engine (prefill or decode)."""

    role: WorkerRole
    kv: KVCacheManager  # its KV pool (a role switch keeps it)

    @property
    def has_work(self) -> bool: ...  # a step would compute something

    @property
    def has_pending_io(self) -> bool: ...  # transfers in flight: keep polling

    @property
    def idle(self) -> bool: ...  # no request held at all

    def step(self) -> list[TokenDelta]: ...

    def io_wait_s(self) -> float: ...

    def abort(self, request_id: str) -> bool: ...

    def load(self, address: str = "") -> WorkerLoad: ...

    def check_integrity(self) -> None: ...

    def request_state(self) -> dict[str, int]: ...

    def on_stop(self) -> None: ...  # the loop stopped: resolve whatever callers wait on


class EngineLoop:
    def __init__(self, engine: RoleEngine, name: str = "engine-loop", address: str = "") -> None:
        self._engine = engine
        self.address = address
        # Refreshed on the loop thread after every step and command batch, so readers (the
        # output long-poll, status) never wait for a step to finish to learn the load.
        self.load: WorkerLoad = engine.load(address)
        self._health = WorkerHealth.HEALTHY  # what every load this loop reports says
        self.error: BaseException | None = None
        self._failure: BaseException | None = None  # ``fail``'s, raised on the loop thread
        self.steps = 0
        self.busy_s = 0.0  # wall time of the steps that computed something (``WorkerLoad.busy_s``)
        self._kv_events = KvEventLog(engine.kv.pool.num_blocks)
        engine.kv.pool.listen(self._kv_events)
        self._cmds: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._wake = threading.Event()
        self._out: list[TokenDelta] = []
        self._out_cv = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def engine(self) -> RoleEngine:
        return self._engine

    @engine.setter
    def engine(self, engine: RoleEngine) -> None:
        """Another role's engine over the same KV pool (a role switch, on the loop thread): the
        routers forgot this worker when it left its pool, so the next take is a snapshot of
        the cache it keeps."""
        if engine.kv.pool is not self._engine.kv.pool:
            raise ValueError("a role switch keeps the KV pool")
        self._engine = engine
        self._kv_events.resync()

    def set_health(self, health: WorkerHealth) -> None:
        """Report ``health`` with every load from now on (DRAINING: route nothing new here)."""
        self._health = health
        self.load = replace(self.load, health=health)
        self._wake.set()

    def refresh_load(self) -> None:
        self.load = replace(self.engine.load(self.address), health=self._health, busy_s=self.busy_s)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        self._check()
        if self._stop.is_set():
            raise WorkerFailed("worker loop stopped")
        fut: Future[Any] = Future()
        self._cmds.append((fn, args, fut))
        self._wake.set()
        if not self._thread.is_alive():  # it stopped meanwhile: its last drain may be over
            self._fail_queued()
        return fut

    def fail(self, error: BaseException) -> None:
        """Stop the loop as if a step had raised ``error``: a part of the worker outside the
        loop is gone (a tensor-parallel rank), so nothing it would step can succeed."""
        self._failure = error
        self._wake.set()

    def wake(self) -> None:
        """Something outside the engine changed (a transfer completed): step soon."""
        self._wake.set()

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 30.0) -> Any:
        return self.submit(fn, *args).result(timeout=timeout_s)

    def collect(self, timeout_s: float) -> list[TokenDelta]:
        """Deltas produced since the last call, each request's consecutive tokens in one delta
        (``coalesce``: a reader that fell behind catches up in fewer, larger messages); waits
        up to ``timeout_s`` for the first one."""
        with self._out_cv:
            if not self._out and self.error is None and not self._stop.is_set():
                self._out_cv.wait(timeout_s)
            out, self._out = self._out, []
        if not out:
            self._check()
        return coalesce(out)

    def take_kv_events(self) -> KvEvents | None:
        """The prefix cache's ops since the last take, in order (a snapshot instead when they
        were not taken for so long that they overflowed); ``None`` when nothing changed."""
        return self._kv_events.take()

    def kv_snapshot(self) -> KvEvents:
        """The prefix cache's whole key set now, ops empty. It reflects every op taken before
        it: a new connection's first batch carries one taken after the latest take (instead of
        that take's ops), and every later take's ops."""
        return self._kv_events.snapshot()

    def _check(self) -> None:
        if self.error is not None:
            raise WorkerFailed(f"worker loop stopped: {self.error!r}") from self.error

    def _run_commands(self) -> None:
        while self._cmds:
            fn, args, fut = self._cmds.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # the caller gets the error; the loop goes on
                fut.set_exception(e)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._failure is not None:
                    raise self._failure
                self._wake.clear()
                if self._cmds:
                    self._run_commands()
                    self.refresh_load()
                eng = self.engine
                if eng.has_work or eng.has_pending_io:
                    computes = eng.has_work  # a step for transfers alone is a poll, not work
                    start = time.perf_counter()
                    deltas = eng.step()
                    if computes:
                        self.busy_s += time.perf_counter() - start
                    self.steps += 1
                    self.refresh_load()
                    if deltas:
                        with self._out_cv:
                            self._out.extend(deltas)
                            self._out_cv.notify_all()
                    if not eng.has_work:
                        self._wake.wait(eng.io_wait_s())
                else:
                    self._wake.wait(IDLE_WAIT_S)
        except BaseException as e:
            log.exception("engine loop failed")
            self.error = e
        finally:
            try:
                self.engine.on_stop()
            except Exception:
                log.exception("engine stop hook failed")
            with self._out_cv:
                self._out_cv.notify_all()
            self._fail_queued()

    def _fail_queued(self) -> None:
        while self._cmds:
            try:
                _, _, fut = self._cmds.popleft()
            except IndexError:  # drained by another thread between the check and the pop
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(WorkerFailed("worker loop stopped"))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
