"""A simulated worker: the product's role engine on the virtual clock.

Each simulated worker runs the product's own engine — ``PrefillEngine``, or ``DecodeEngine``
as a decode or colocated worker — with the virtual ports of ``pdserve.simulator.virtual``: a
runner that computes nothing, a transport that takes the profile's link time, and the clock.
So reservations and their headroom, admission, chunked prefill, prefix caching, preemption,
recompute and the hand-off are the service's code, not a copy of it. A worker steps whenever
it has work or a transfer finished: the engine's ``step()`` moves its state at the step's
start, the step-time model says how long the step takes, and what the step reports (tokens,
first tokens, reservations granted) reaches the router at its end. Commands reach an engine
when the router sends them.

A deployment whose workers share one host (``shared_host``: a CPU, where the workers' cores
share caches and memory and the router runs beside them) slows steps by the profile's
measured co-activity (``pdserve.simulator.calibration``): the state at a step's start decides
it. A profile that measured how its steps scatter (``HostCalibration.prefill_jitter`` /
``decode_jitter`` / ``jitter_corr``) has each worker draw every step's factor from that
distribution (``pdserve.simulator.jitter``), seeded by ``jitter_seed`` and the worker's id, so
a run is reproducible and runs with other seeds show the spread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.handlers import COLOCATED_HANDLERS, DECODE_HANDLERS
from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.prefill_worker.handlers import PREFILL_HANDLERS
from pdserve.simulator.fast_run import DecodeRun
from pdserve.simulator.fast_step import Steady, decode_step, prefill_step
from pdserve.simulator.prompt_memo import prompt_blocks, prompt_keys
from pdserve.simulator.replicas import WorkerReports
from pdserve.simulator.virtual import SimRuntime, SimTransport
from pdserve.steptime.model import StepTimeModel, has_prefill
from pdserve.worker.commands import Answer, Command, UnsupportedCommand
from pdserve.worker.handlers import Handlers, handler_for
from pdserve.worker.messages import KvEvents, TokenDelta, WorkerLoad, WorkerRole

if TYPE_CHECKING:
    from pdserve.simulator.cluster import Cluster


# Each role's commands, as the worker process's host runs them.
ROLE_HANDLERS: dict[WorkerRole, Handlers] = {
    WorkerRole.PREFILL: PREFILL_HANDLERS,
    WorkerRole.DECODE: DECODE_HANDLERS,
    WorkerRole.COLOCATED: COLOCATED_HANDLERS,
}


class KvOps:
    """A simulated worker's prefix-cache ops since the router last took them: a worker's
    ``KvEventLog`` without its lock, bound and snapshots (the simulated router takes them on
    the same thread at every step's end, and never reconnects). A run logs every block its
    workers publish and evict, so this is kept to an append."""

    def __init__(self) -> None:
        self._ops: list[tuple[bool, bytes]] = []

    def stored(self, key: bytes) -> None:
        self._ops.append((True, key))

    def removed(self, key: bytes) -> None:
        self._ops.append((False, key))

    def take(self) -> KvEvents | None:
        if not self._ops:
            return None
        ops, self._ops = self._ops, []
        return KvEvents(tuple(ops))


class SimWorker:
    """One worker: a real role engine, stepped on the clock."""

    def __init__(
        self, wid: str, role: WorkerRole, profile: StepTimeModel, config: SchedulerConfig,
        block_size: int, cluster: Cluster,
    ) -> None:  # fmt: skip
        self.wid, self.profile, self.cluster = wid, profile, cluster
        kv = KVCacheManager(
            max(1, profile.kv_capacity_tokens // block_size),
            block_size,
            prompt_keys=lambda prompt: prompt_keys(prompt, block_size),
            prompt_blocks=lambda prompt: prompt_blocks(prompt, block_size),
        )
        self.rt = SimRuntime(kv, block_size, profile.max_model_len)
        self.kv_events = KvOps()  # its prefix cache's changes, for the router
        kv.pool.listen(self.kv_events)
        self.transport: SimTransport | None = None
        if role is not WorkerRole.COLOCATED:
            self.transport = SimTransport(wid, cluster.link, self.kick)
        self.become(role, config)
        self.retiring = False  # routed nothing new; leaves (or switches role) once idle
        self.lost = False  # gone (``Cluster.lose``): takes no command, and steps no more
        self.on_idle: Callable[[], None] | None = None
        self.busy = False
        self.prefilling = False  # the step in flight has prefill work
        self._effects: list[Callable[[], None]] = []  # what the step in flight reports at its end
        self._load: WorkerLoad | None = None  # cached until the worker's state changes
        self.jitter = cluster.jitter_for(wid)
        self.fast = cluster.fast_steps  # decode-only steps without the engine's machinery
        self.run: DecodeRun | None = None  # decode steps whose effects wait to be looked at
        self._run_load: tuple[DecodeRun, WorkerLoad, int, WorkerLoad] | None = None
        # with router replicas: who owns what here, and what each replica heard of the others
        self.reports = WorkerReports(cluster.routers) if cluster.routers > 1 else None

    def become(self, role: WorkerRole, config: SchedulerConfig) -> None:
        """Run ``role``'s engine over the same KV pool (a new worker, or an idle one switching)."""
        self._engine: PrefillEngine | DecodeEngine
        if role is WorkerRole.PREFILL:
            assert self.transport is not None
            self._engine = PrefillEngine(self.rt, self.transport, config, self.wid)
        else:
            clock = self.cluster.clock
            self._engine = DecodeEngine(self.rt, self.transport, config, self.wid, role, clock=clock)
        self._load = None

    @property
    def engine(self) -> PrefillEngine | DecodeEngine:
        """The role engine, as the steps started so far left it (whoever may change it next:
        a decode run stops at its step in flight)."""
        self.settle()
        return self._engine

    @property
    def role(self) -> WorkerRole:
        """The role it runs now: its engine's."""
        return self._engine.role

    @property
    def kv(self) -> KVCacheManager:
        return self.rt.kv

    @property
    def prefill(self) -> PrefillEngine:
        assert isinstance(self.engine, PrefillEngine)
        return self.engine

    @property
    def decode(self) -> DecodeEngine:
        assert isinstance(self.engine, DecodeEngine)
        return self.engine

    # -- load, as the router's policy sees it --------------------------------------------------
    def load(self) -> WorkerLoad:
        if self._load is None:
            self._load = self._engine.load()
        run = self.run
        if run is None:
            return self._load
        grows = run.pending_grows()
        if not grows:
            return self._load
        # A decode run's steps not applied yet change the load only by the blocks they took:
        # from the head of the free queue, cached keys first out (the load ``apply`` would give).
        # The router reads every worker's load at every arrival: the same answer until the run
        # takes more blocks (only its own steps change the pool while it runs uncut).
        memo = self._run_load
        if memo is not None and memo[0] is run and memo[1] is self._load and memo[2] == grows:
            return memo[3]
        pool = self.kv.pool
        load = replace(
            self._load,
            kv_free=self._load.kv_free - grows,
            kv_cached=self._load.kv_cached - pool.cached_among_next(grows),
        )
        self._run_load = (run, self._load, grows, load)
        return load

    def load_for(self, replica: int) -> WorkerLoad:
        """The load as router replica ``replica`` sees it (``pdserve.simulator.replicas``)."""
        if self.reports is None:
            return self.load()
        return self.reports.load_for(replica, self.load(), self.cluster.clock.now, self.busy)

    def _report(self) -> None:
        """The worker's load report, at a step's end (router replicas only)."""
        if self.reports is not None:
            run = self.run
            undelivered = run.ended - run.delivered if run is not None else 0
            self.reports.report(self.cluster.clock.now, undelivered)

    def changed(self) -> None:
        self._load = None

    def later(self, effect: Callable[[], None]) -> None:
        """Run ``effect`` when the step in flight ends (now, if none is)."""
        self.settle()
        if self.busy:
            self._effects.append(effect)
        else:
            effect()

    # -- stepping --------------------------------------------------------------------------------
    def kick(self) -> None:
        """Step if there is anything to step for."""
        self._load = None  # every caller just changed this worker's state
        if self.lost:
            return
        if self.busy:
            self.settle()  # (a transfer landed: the next step takes it in)
            return
        # What the steps so far did to the prefix cache reaches the router now, at a step's end
        # (a step's changes are made at its start here), as a worker's output batch brings them.
        if (events := self.kv_events.take()) is not None:
            self.cluster.on_kv_events(self, events)
        if self.transport is not None:
            self.transport.start_queued(self.cluster.clock.now)  # pushes commands started
        io = self.transport is not None and self.transport.has_completions
        if not (self._engine.has_work or io):
            return
        self.busy = True
        if self.fast and not io and self._start_run():
            return
        fast = None
        if self.fast:  # steady steps without the engine's machinery
            e = self._engine
            if isinstance(e, DecodeEngine):
                fast = decode_step(e)  # (it takes in landed transfers first, as step() does)
            elif not io:
                fast = prefill_step(e)
        if fast is not None:
            end = self.cluster.clock.now + self._duration(fast.chunks)
            self.cluster.clock.at(end, lambda: self._done_fast(fast))
            return
        deltas = self._engine.step()
        chunks = [(c.num_tokens, c.start_pos) for c in self.rt.runner.take()]
        dur = self._duration(chunks)
        end = self.cluster.clock.now + dur
        if self.transport is not None:
            self.transport.start_queued(end)  # pushes of the prompts this step completed
        if dur > 0:
            self.cluster.clock.at(end, lambda: self._done(deltas))
        else:  # nothing to compute: only a command or a transfer can change that (they kick)
            self._done(deltas, again=False)

    # -- runs of decode steps (pdserve.simulator.fast_run) ----------------------------------------
    def _start_run(self) -> bool:
        """Start a run of decode steps here if one lies ahead (the step-time model alone prices
        them: no jitter, no shared host)."""
        e = self._engine
        if self.jitter is not None or self.cluster.shared_host or not isinstance(e, DecodeEngine):
            return False
        run = DecodeRun.plan(e, self.profile)
        if run is None:
            return False
        for req in run.rows:  # every row's first token is out: its steps' tokens only add times
            sr = self.cluster.requests.get(req.request_id)
            if sr is None or not sr.token_times:
                return False
        self.run = run
        if self.reports is not None:
            self.reports.start_run([req.request_id for req in run.rows])
        self._run_step()
        return True

    def _run_step(self) -> None:
        run = self.run
        assert run is not None
        run.started += 1
        end = self.cluster.clock.now + run.duration(run.started)
        run.ends.append(end)
        self.cluster.clock.at(end, self._run_tick)

    def _run_tick(self) -> None:
        """A step of the run ended: the next starts, unless the run is over (then the worker
        catches up and steps as usual)."""
        run = self.run
        assert run is not None
        if self.lost:
            return
        run.ended = run.started
        if not run.cut and run.started < run.limit:
            self._run_step()
            self._report()
            return
        run.apply(run.started)
        self._deliver_run(run)
        self.run = None
        self.busy = self.prefilling = False
        self._load = None
        self._report()
        effects, self._effects = self._effects, []
        for effect in effects:
            effect()
        self.kick()
        self._check_idle()

    def settle(self) -> None:
        """Make the run's effects so far real and end it with its step in flight: something
        outside is about to change this worker, or read more than its load."""
        run = self.run
        if run is None or run.cut:
            return
        run.apply(run.started)
        self._deliver_run(run)
        run.cut = True
        self._load = None

    def _deliver_run(self, run: DecodeRun) -> None:
        """The router gets the tokens of the run's steps ended so far."""
        if self.reports is not None and run.ended > run.delivered:
            for req in run.rows:
                self.reports.tokens(req.request_id, run.ended - run.delivered, False)
        run.deliver(self.cluster.requests.get, run.ended)

    def _duration(self, chunks: list[tuple[int, int]]) -> float:
        """How long a step of ``chunks`` takes on this worker now."""
        dur = self.profile.step_time(chunks) if chunks else 0.0
        if dur > 0:
            cluster = self.cluster
            if cluster.shared_host or self.jitter is not None:  # the others skip classifying steps
                self.prefilling = has_prefill(chunks)
            if cluster.shared_host:  # only workers sharing a host read each other's step kind
                dur *= cluster.coactivity(self)
            if self.jitter is not None:
                dur *= self.jitter.factor(self.prefilling)
        return dur

    def _done_fast(self, step: Steady) -> None:
        """A steady step (``pdserve.simulator.fast_step``) ended: as ``_done``, each row's token
        reported as its one-token delta would be."""
        self.busy = self.prefilling = False
        self._load = None
        if self.reports is not None:
            for req in step.rows:
                self.reports.tokens(req.request_id, 1, req in step.finished)
            self._report()
        effects, self._effects = self._effects, []
        for effect in effects:
            effect()
        self.cluster.on_tokens(self, step.rows, step.finished)
        self.kick()
        self._check_idle()

    def _done(self, deltas: list[TokenDelta], again: bool = True) -> None:
        self.busy = self.prefilling = False
        self._load = None
        if self.reports is not None:
            for d in deltas:
                self.reports.on_delta(d)
            self._report()
        effects, self._effects = self._effects, []
        for effect in effects:
            effect()
        for d in deltas:
            self.cluster.on_delta(self, d)
        if again:
            self.kick()
        self._check_idle()

    def _check_idle(self) -> None:
        if self.on_idle is not None and not self.busy and self._engine.idle:
            fn, self.on_idle = self.on_idle, None
            fn()

    def execute(self, cmd: Command, owner: int = 0) -> Answer | Future[Answer]:
        """A router command, through its role's handler table (the one a worker process
        dispatches through): it reaches the engine now (a push it starts begins now, or when
        the step in flight ends). Its answer, or a future of it. ``owner``: the router replica
        that sent it."""
        handler = handler_for(ROLE_HANDLERS[self.role], cmd)
        if handler is None:
            raise UnsupportedCommand(f"a {self.role.value} worker takes no {type(cmd).__name__} command")
        self.settle()
        reports = self.reports
        if reports is None:
            answer = handler(self._engine, cmd)
        else:
            reports.before(owner, cmd)
            try:
                answer = handler(self._engine, cmd)
            except Exception:
                reports.failed(cmd)
                raise
            reports.after(cmd, None if isinstance(answer, Future) else answer)
        self.kick()
        self._check_idle()
        return answer
