"""The worker process shell: runtime + KV transport + role engine + step loop.

``WorkerHost`` is what Ray places as an actor (``pdserve.prefill_worker.actor``,
``pdserve.decode_worker.actor`` give it its roles); it is a plain class, so tests and the
single-process mode run it without Ray. Every public method is safe to call from any thread:
engine work goes through the loop.

Two entries, each one typed dispatch: ``execute`` (``run`` in process) takes the request
commands (``pdserve.worker.commands``, through the role's handler table), ``control`` the
process-level messages (``pdserve.worker.control``, through its one table); a Ray actor is
called only through ``control``.

Lifecycle: ``__init__`` loads the model and opens the transport -> ``GetInfo`` (ready) ->
commands and ``collect()`` -> ``drain`` (optional) -> ``Shutdown``.

SIGTERM (a worker process of a cluster, ``drain_on_sigterm``): the worker drains, then exits.
Its loads say DRAINING from then on, and the router starts its replacement at once (a surge);
it keeps routing to the draining worker only while no other worker of its role takes
requests, and says ``Release`` once one does. The worker serves until then, and then what it
holds, within ``drain_timeout_s`` in all; then it closes its channel and exits, and the router
moves whatever is left to other workers (migration), as for any lost worker.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from pdserve.kvtransfer.emulated_link import EmulatedLink
from pdserve.kvtransfer.transport import KVTransport
from pdserve.model_runtime.engine.model_runner import ModelRunner
from pdserve.model_runtime.engine.runtime import Runtime, build_runtime, torch_device
from pdserve.model_runtime.engine.step_log import LoggedRunner, StepLog
from pdserve.model_runtime.kv_cache.block_pool import IntegrityError
from pdserve.model_runtime.parallel.group import RankLost
from pdserve.model_runtime.platform import use_threads
from pdserve.worker.commands import Answer, Command, Release, UnsupportedCommand
from pdserve.worker.control import Control, run_control
from pdserve.worker.handlers import Handlers, answer_of, handler_for
from pdserve.worker.loop import EngineLoop, RoleEngine
from pdserve.worker.messages import OutputBatch, WorkerHealth, WorkerInfo, WorkerLoad, WorkerRole
from pdserve.worker.push import OutputPusher
from pdserve.worker.rank_main import RankTransportSettings
from pdserve.worker.rank_main import main as rank_main
from pdserve.worker.ranked_transport import RankedTransport
from pdserve.worker.spec import WorkerSpec

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Role:
    """How a host runs one role: its engine, and the table of the commands it takes."""

    make_engine: Callable[[WorkerHost], RoleEngine]
    handlers: Handlers
    transport: bool  # it moves KV (a KV transport is opened for it)
    listens: bool  # it receives KV (its transport listens; its address goes to the router)


def _shared_cache_allocator(spec: WorkerSpec, receives: bool) -> tuple[Any, list[Path]]:
    """Workers that receive KV (or may, after a role switch) on CPU keep their cache in
    /dev/shm, so same-host senders write into it directly."""
    paths: list[Path] = []
    if not receives or spec.transport.backend not in ("auto", "shm"):
        return None, paths
    if torch_device(spec.engine).type != "cpu":
        return None, paths
    from pdserve.kvtransfer.datapath import allocate_shared_kv_cache

    def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t, path = allocate_shared_kv_cache(shape, dtype)
        paths.append(path)
        return t

    return allocate, paths


class WorkerHost:
    """A worker process of one of the roles in ``ROLES`` (each subclass says which it can run;
    one that can run several switches between them in place: ``switch_role``)."""

    ROLES: ClassVar[Mapping[WorkerRole, Role]] = {}

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.role not in self.ROLES:
            raise ValueError(f"{type(self).__name__} cannot run a {spec.role.value} worker")
        use_threads(spec.num_threads)
        self.spec = spec
        receives = any(r.listens for r in self.ROLES.values())
        allocator, shm_paths = _shared_cache_allocator(spec, receives)
        # A tensor-parallel worker's other ranks open their own transports with these settings.
        rank_settings = RankTransportSettings(
            spec.secret, spec.transport, allocator is not None, spec.internal_tls
        )
        self.rt: Runtime = build_runtime(spec.engine, allocator, rank_main, rank_settings)
        self._shm_path = shm_paths[0] if shm_paths else None  # (filled while the runtime was built)
        self.step_log: StepLog | None = None
        if spec.engine.step_log:
            self.step_log = StepLog(Path(spec.engine.step_log) / f"{spec.worker_id}.jsonl")
            self.rt.runner = LoggedRunner(self.rt.runner, self.step_log)
        self.transport: RankedTransport | None = None
        self.address = ""  # the transport's, once it listens
        role = self.ROLES[spec.role]
        self._open_transport(role)
        self.engine: RoleEngine = role.make_engine(self)
        self.loop = EngineLoop(self.engine, name="engine-loop", address=self.address if role.listens else "")
        setup = self.rt.ranks
        if setup is not None and setup.ranks is not None:  # a rank that exits fails the worker at once
            setup.ranks.watch(lambda rank: self.loop.fail(RankLost(f"rank {rank} of the worker exited")))
        if self.transport is not None:
            self.transport.on_completion(self.loop.wake)
        self._info = WorkerInfo(
            worker_id=spec.worker_id,
            role=spec.role,
            address=self.loop.address,
            model_dir=str(self.rt.checkpoint.path),
            architecture=self.rt.model_config.architecture,
            vocab_size=self.rt.model_config.vocab_size,
            max_model_len=self.rt.max_model_len,
            block_size=self.rt.block_size,
            dtype=str(self.rt.dtype).removeprefix("torch."),
            kv_blocks=self.rt.kv.num_blocks,
            max_logprobs=spec.engine.max_logprobs,
            has_tokenizer=self.rt.tokenizer is not None,
            pid=os.getpid(),
            node=socket.gethostname(),
            step_tokens=spec.engine.scheduler.max_num_batched_tokens,
            tp=spec.engine.tp,
            kv_ranks=self.rt.ranks.group.size if self.rt.ranks is not None else 1,
        )
        self.pusher: OutputPusher | None = None
        if spec.router_address:
            self.pusher = OutputPusher(
                self.loop,
                self.load,
                self.info,
                spec.worker_id,
                (spec.router_address, *spec.replica_addresses),
                spec.secret,
                self.execute,
                spec.internal_tls,
            )
        self._terminating = threading.Event()
        self._released = threading.Event()  # the router routes nothing new here (``Release``)
        if spec.drain_on_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    @property
    def role(self) -> WorkerRole:
        """The role it runs now: its engine's (one source, swapped in one step)."""
        return self.engine.role

    def _open_transport(self, role: Role) -> bool:
        """Open (and start listening on) the KV transport ``role`` needs; True if it is new."""
        new = role.transport and self.transport is None
        if new:
            spec = self.spec
            transport = KVTransport(
                self.rt.kv_cache, spec.secret, spec.transport, self._shm_path, spec.internal_tls
            )
            profile = self.rt.profile
            # An emulated GPU's stand-in cache moves in microseconds; its link would not.
            own = (
                transport
                if profile is None
                else EmulatedLink(transport, profile.transfer_time, self.rt.block_size)
            )
            setup = self.rt.ranks
            self.transport = RankedTransport(
                own,
                setup.ranks if setup is not None else None,
                setup.group.size if setup is not None else 1,
                self.rt.model_config.num_kv_heads,
            )
            if setup is not None:
                runner = self.rt.runner
                inner = getattr(runner, "inner", runner)  # (under a step log's wrapper)
                if isinstance(inner, ModelRunner):
                    inner.layer_pushes = self.transport.take_layer_pushes
        if role.listens and not self.address:
            assert self.transport is not None
            self.address = self.transport.listen()
        return new

    def switch_role(self, role: WorkerRole | str) -> WorkerInfo:
        """Run as ``role`` from now on, keeping the weights and the KV pool (with its prefix
        cache); returns the worker's new info. Only while it holds no request (drain it first):
        raises ``ValueError`` otherwise, or for a role this worker cannot run."""
        role = WorkerRole(role)
        if role not in self.ROLES:
            raise ValueError(f"a {type(self).__name__} cannot run as {role.value}")
        info: WorkerInfo = self.loop.call(self._switch, role)
        return info

    def _switch(self, role: WorkerRole) -> WorkerInfo:
        # On the loop thread, between steps: no step sees half an engine.
        if not self.engine.idle:
            raise ValueError(f"worker {self.spec.worker_id} holds requests: drain it before it switches role")
        impl = self.ROLES[role]
        if self._open_transport(impl):
            assert self.transport is not None
            self.transport.on_completion(self.loop.wake)
        self.engine = self.loop.engine = impl.make_engine(self)
        self.loop.address = self.address if impl.listens else ""
        self.loop.refresh_load()
        self._info = replace(self._info, role=role, address=self.loop.address)
        log.info("%s: now a %s worker", self.spec.worker_id, role.value)
        return self._info

    # -- API for the router: ``control`` (below, what its table runs) and ``execute`` ----------
    def control(self, msg: Control[T]) -> T:
        """Run a process-level control message (``pdserve.worker.control``); its answer."""
        return run_control(self, msg)

    def info(self) -> WorkerInfo:
        return self._info

    def load(self) -> WorkerLoad:
        """The load as of the last step or command (no wait on a running step)."""
        return self.loop.load

    def collect(self, timeout_s: float = 1.0) -> OutputBatch:
        """Long poll: all deltas since the last call (waits up to ``timeout_s`` for one). Only
        for workers without an output channel (``router_address``): a delta goes out once."""
        deltas = self.loop.collect(min(max(timeout_s, 0.0), 10.0))
        return OutputBatch(tuple(deltas), self.load())

    def execute(self, cmd: Command) -> Future[Answer]:
        """Run a router command on the engine's thread (between steps, in arrival order); the
        future holds its answer. Raises ``UnsupportedCommand`` for another role's command."""
        if isinstance(cmd, Release):
            self._released.set()
            done: Future[Answer] = Future()
            done.set_result(True)
            return done
        return self._execute_role(cmd)

    def _execute_role(self, cmd: Command) -> Future[Answer]:
        eng = self.engine  # read once: the role that takes the command is this engine's
        handler = handler_for(self.ROLES[eng.role].handlers, cmd)
        if handler is None:
            raise UnsupportedCommand(f"a {eng.role.value} worker takes no {type(cmd).__name__} command")
        return answer_of(self.loop.submit(handler, eng, cmd))

    def run(self, cmd: Command, timeout_s: float = 30.0) -> Answer:
        """``execute`` and wait for the answer: the router's commands, in process."""
        return self.execute(cmd).result(timeout=timeout_s)

    def check_integrity(self) -> None:
        """Raise if blocks or per-request state leaked (checked while no request is held)."""
        self.loop.call(self.engine.check_integrity)
        owned = self.pusher.owned() if self.pusher is not None else 0
        if owned and self.loop.call(lambda: self.engine.idle):
            raise IntegrityError(f"idle, but the worker channel still knows the router of {owned} request(s)")

    def request_state(self) -> dict[str, int]:
        """Sizes of every per-request map of the engine, its KV manager and its transport."""
        state: dict[str, int] = self.loop.call(self.engine.request_state)
        if self.pusher is not None:
            state["channel_owners"] = self.pusher.owned()
            if len(self.pusher.addresses) > 1:  # each router's share (router replicas)
                state |= {f"owned_by_router_{i}": n for i, n in enumerate(self.pusher.owned_by())}
        return state

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is held (tests use it to wait for cleanup to settle)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.loop.call(lambda: self.engine.idle):
                return True
            time.sleep(0.01)
        return False

    def set_leaving(self, leaving: bool) -> None:
        """A planned change takes this worker out of its pool (``leaving``), or gave that up:
        report DRAINING, or HEALTHY again (not after SIGTERM: that drain goes on)."""
        if leaving or not self._terminating.is_set():
            self.loop.set_health(WorkerHealth.DRAINING if leaving else WorkerHealth.HEALTHY)

    def drain(self, timeout_s: float, until_released: bool = False) -> bool:
        """Report DRAINING (the router routes nothing new here once another worker of this
        role takes requests) and wait up to ``timeout_s`` for the requests held to finish; True
        if none is left. ``until_released``: first wait, within the same ``timeout_s``, for the
        router's ``Release`` (the last worker of its role serves new requests until its
        replacement is up: idle between two of them is no reason to leave). The worker keeps
        serving."""
        deadline = time.monotonic() + timeout_s
        self.loop.set_health(WorkerHealth.DRAINING)
        if until_released:
            self._released.wait(timeout_s)
        return self.wait_idle(max(0.0, deadline - time.monotonic()))

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # A signal handler must not block the thread it interrupts: drain on another one.
        if not self._terminating.is_set():
            self._terminating.set()
            threading.Thread(target=self._drain_and_exit, name="sigterm-drain", daemon=True).start()

    def _drain_and_exit(self) -> None:
        timeout = self.spec.drain_timeout_s
        log.warning("%s: SIGTERM: draining (up to %gs), then exiting", self.spec.worker_id, timeout)
        try:
            clean = self.drain(timeout, until_released=self.pusher is not None)
            outcome = "drained" if clean else "drain timed out (the router moves what is left)"
            log.warning("%s: %s; exiting", self.spec.worker_id, outcome)
            self.shutdown()
        finally:
            logging.shutdown()
            os._exit(0)

    def shutdown(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        self.loop.stop()
        try:
            if self.transport is not None:
                self.transport.close()
        finally:
            self.rt.close()  # a TP worker's other ranks stop with it
        if self.step_log is not None:
            self.step_log.close()
