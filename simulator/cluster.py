"""The simulated cluster: workers that step on a virtual clock, a router that dispatches.

A worker steps whenever it has work: it asks its real scheduler for a plan, the latency model
for the plan's duration, and applies the plan when that time has passed (every sampled token is
a fixed id; lengths come from the workload, and every request ignores EOS). The router's real
dispatcher decides each request, with the same feedback the service gives it (first token,
end, load reports). Remotely prefilled requests follow the service's path: the decode worker
reserves blocks (waiting for room when full), the prefill worker computes and emits the first
token, the KV takes the profile's link time, then the request joins the decode batch. Locally
prefilled ones (colocated, or conditional disaggregation) join the decode worker's scheduler as
new prompts; rejected ones end at once as failures.

A deployment whose workers share one host (``shared_host``: this CPU, where the workers' cores
share caches and memory and the router runs beside them) slows steps by the profile's measured
co-activity factors: a decode-only step that starts while another worker runs a prefill step,
and a prefill step that starts while another worker steps. The state at a step's start decides
it; steps are short against the prefills that cause most of the slowdown.

A profile that measured how its steps scatter (``HostCalibration.prefill_jitter`` /
``decode_jitter`` / ``jitter_corr``) has each worker draw every step's factor from that
distribution (``pdserve.simulator.jitter``), seeded by ``jitter_seed`` and the worker's id, so a run is
reproducible and runs with other seeds show the spread; other profiles step deterministically.
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.model_runtime.kv_cache.manager import KVCacheManager, blocks_needed
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.colocated import ColocatedScheduler
from pdserve.model_runtime.scheduler.plan import ScheduledChunk, SchedulePlan, SchedulerConfig
from pdserve.model_runtime.scheduler.prefill import PrefillScheduler
from pdserve.router.policy import Dispatcher, Outcome, RouteRequest
from pdserve.router.prefix import block_keys
from pdserve.router.slo import SloClass
from pdserve.simulator.calibration import calibration_of
from pdserve.simulator.jitter import StepJitter
from pdserve.steptime.model import StepTimeModel, is_decode_chunk
from pdserve.worker.messages import WorkerLoad, WorkerRole

TOKEN = 1  # every sampled token: content does not matter to scheduling


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self) -> None:
        while self._events:
            self.now, _, fn = heapq.heappop(self._events)
            fn()


@dataclass
class SimRequest:
    req: Request
    arrival: float
    token_times: list[float] = field(default_factory=list)
    prefill_worker: SimWorker | None = None
    decode_worker: SimWorker | None = None
    twin: Request | None = None  # the prefill worker's copy (disaggregated)
    reserved: bool = False
    prefilled: bool = False
    done: bool = False
    rejected: bool = False


class SimWorker:
    def __init__(
        self,
        wid: str,
        role: WorkerRole,
        profile: StepTimeModel,
        config: SchedulerConfig,
        block_size: int,
        clock: Clock,
        cluster: Cluster,
    ) -> None:
        self.wid, self.role, self.profile, self.clock, self.cluster = wid, role, profile, clock, cluster
        self.kv = KVCacheManager(max(1, profile.kv_capacity_tokens // block_size), block_size)
        self.sched: PrefillScheduler | ColocatedScheduler = (
            PrefillScheduler(self.kv, config)
            if role is WorkerRole.PREFILL
            else ColocatedScheduler(self.kv, config)
        )
        self.requests: dict[str, SimRequest] = {}
        self.busy = False
        self.prefilling = False  # the step in flight has prefill work
        self.reservations: deque[SimRequest] = deque()  # decode: waiting for room
        self.sending = 0  # prefill: requests whose KV is still being handed off
        self._load: WorkerLoad | None = None  # cached until the worker's state changes
        self.jitter = cluster.jitter_for(wid)

    # -- load, as the router's policy sees it --------------------------------------------------
    def load(self) -> WorkerLoad:
        if self._load is None:
            self._load = self._compute_load()
        return self._load

    def changed(self) -> None:
        self._load = None

    def _compute_load(self) -> WorkerLoad:
        s = self.kv.stats()
        if isinstance(self.sched, PrefillScheduler):
            running, waiting = self.sched.num_running + self.sending, self.sched.num_waiting
        else:
            running, waiting = self.sched.num_running, self.sched.num_waiting + len(self.reservations)
        return WorkerLoad(self.wid, self.role, "", running, waiting, s.total, s.free + s.cached, s.cached)

    # -- stepping --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        if isinstance(self.sched, PrefillScheduler):
            return bool(self.sched.num_waiting or self.sched.num_running)
        return self.sched.has_work

    def kick(self) -> None:
        self._load = None  # every caller just changed this worker's state
        if self.busy or not self.has_work():
            return
        plan: SchedulePlan | None = None
        if isinstance(self.sched, PrefillScheduler):
            chunks, _ = self.sched.schedule()
        else:
            plan = self.sched.schedule()
            chunks = list(plan.chunks)
        if not chunks:
            return
        self.busy = True
        dur = self.profile.step_time((c.num_tokens, c.start_pos) for c in chunks)
        if self.cluster.shared_host or self.jitter is not None:  # the others skip classifying every step
            self.prefilling = not all(is_decode_chunk(c.num_tokens, c.start_pos) for c in chunks)
        if self.cluster.shared_host:  # only workers sharing a host read each other's step kind
            dur *= self.cluster.coactivity(self)
        if self.jitter is not None:
            dur *= self.jitter.factor(self.prefilling)
        self.clock.at(self.clock.now + dur, lambda: self._done(chunks, plan))

    def _done(self, chunks: list[ScheduledChunk], plan: SchedulePlan | None) -> None:
        now = self.clock.now
        sampled = {c.request_id: TOKEN for c in chunks if c.sample}
        if isinstance(self.sched, PrefillScheduler):
            update = self.sched.update(chunks, sampled)
            for r in update.prefilled:
                self.cluster.on_prefilled(self, self.requests[r.request_id])
            for r in update.finished:  # the first token was the last (max_tokens = 1)
                sr = self.requests.pop(r.request_id)
                sr.token_times.append(now)
                self.cluster.finish_before_decode(sr)
        else:
            assert plan is not None
            update = self.sched.update(plan, sampled)
            for rid in sampled:
                running = self.requests.get(rid)
                if running is not None:
                    running.token_times.append(now)
                    self.cluster.on_token(running)
            for r in update.finished:
                self.cluster.finish(self.requests.pop(r.request_id))
            self.try_reserve()
        self.busy = self.prefilling = False
        self.kick()

    # -- decode side -----------------------------------------------------------------------------
    def try_reserve(self) -> None:
        while self.reservations:
            sr = self.reservations[0]
            n = sr.req.num_prompt_tokens
            headroom = self.kv.num_free_blocks - blocks_needed(n, self.kv.block_size)
            if headroom < self.sched.num_running or not self.kv.allocate_slots(sr.req, n):
                return
            self.reservations.popleft()
            self._load = None
            sr.reserved = True
            self.cluster.maybe_transfer(sr)

    def admit_decode(self, sr: SimRequest) -> None:
        """The KV arrived: the request joins the batch with its first token."""
        req = sr.req
        req.num_computed_tokens = req.num_prompt_tokens
        req.append_token(TOKEN)
        if req.check_token_stop():
            self.kv.free(req.request_id)
            self.cluster.finish(sr)
            return
        self.requests[req.request_id] = sr
        assert isinstance(self.sched, ColocatedScheduler)
        self.sched.decode.add(req)
        self.kick()


class Cluster:
    def __init__(
        self,
        profile: StepTimeModel,
        prefill: int,
        decode: int,
        colocated: int,
        dispatcher: Dispatcher,
        prefill_config: SchedulerConfig,
        decode_config: SchedulerConfig,
        block_size: int = 16,
        slo: SloClass | None = None,
        shared_host: bool = False,
        jitter_seed: int = 0,
    ) -> None:
        self.clock = Clock()
        self.profile = profile
        self.calibration = calibration_of(profile)
        self.shared_host = shared_host
        self.jitter_seed = jitter_seed
        self.colocated = colocated > 0

        def mk(i: int, role: WorkerRole, cfg: SchedulerConfig) -> SimWorker:
            return SimWorker(f"{role.value}-{i}", role, profile, cfg, block_size, self.clock, self)

        if self.colocated:
            self.decoders = [mk(i, WorkerRole.COLOCATED, decode_config) for i in range(colocated)]
            self.prefillers: list[SimWorker] = []
        else:
            self.prefillers = [mk(i, WorkerRole.PREFILL, prefill_config) for i in range(prefill)]
            self.decoders = [mk(i, WorkerRole.DECODE, decode_config) for i in range(decode)]
        self.by_id = {w.wid: w for w in (*self.prefillers, *self.decoders)}
        self.dispatcher = dispatcher
        self.slo = slo
        self.block_size = block_size
        self.finished: list[SimRequest] = []
        self.decisions: dict[str, int] = {}  # "outcome/reason" -> count
        self.max_model_len = profile.max_model_len

    def jitter_for(self, wid: str) -> StepJitter | None:
        """``wid``'s step-time variability, if the profile measured any (its own stream of
        draws: one worker's steps do not shift another's)."""
        cal = self.calibration
        if not cal.varies:
            return None
        rng = random.Random(f"{self.jitter_seed}/{wid}")
        return StepJitter(cal.prefill_jitter, cal.decode_jitter, cal.jitter_corr, rng)

    def coactivity(self, w: SimWorker) -> float:
        """The slowdown of the step ``w`` is starting on the shared host, from what the host's
        other workers run."""
        others = [o for o in self.by_id.values() if o is not w and o.busy]
        return self.calibration.coactivity(w.prefilling, bool(others), any(o.prefilling for o in others))

    def submit(self, arrival: float, rid: str, prompt: tuple[int, ...], output_len: int) -> SimRequest:
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        sr = SimRequest(Request(rid, prompt, params), arrival)
        self.clock.at(arrival, lambda: self._arrive(sr))
        return sr

    def _arrive(self, sr: SimRequest) -> None:
        req = sr.req
        route = RouteRequest(
            req.num_prompt_tokens, req.params.max_tokens, request_id=req.request_id,
            block_keys=block_keys(req.prompt_token_ids, self.block_size), slo=self.slo,
        )  # fmt: skip
        now = self.clock.now
        decision = self.dispatcher.decide(
            route, [w.load() for w in self.prefillers], [w.load() for w in self.decoders], now
        )
        key = f"{decision.outcome.value}/{decision.reason}"
        self.decisions[key] = self.decisions.get(key, 0) + 1
        if decision.outcome is Outcome.REJECTED:
            sr.rejected = True
            self.finish(sr)
            return
        req.priority = decision.priority
        d = self.by_id[decision.decode_worker]
        sr.decode_worker = d
        if decision.prefill_worker is None:
            d.requests[req.request_id] = sr
            assert isinstance(d.sched, ColocatedScheduler)
            d.sched.add_request(req)
            d.kick()
            self.dispatcher.on_report(d.load())  # simulated loads are always fresh
            return
        p = self.by_id[decision.prefill_worker]
        sr.prefill_worker = p
        # The prefill side works on its own copy of the request; decode reserves for the original.
        twin = Request(req.request_id, req.prompt_token_ids, req.params, priority=decision.priority)
        p.requests[twin.request_id] = sr
        sr.twin = twin
        assert isinstance(p.sched, PrefillScheduler)
        p.sched.add(twin)
        p.kick()
        d.reservations.append(sr)
        d.changed()
        d.try_reserve()
        self.dispatcher.on_report(d.load())
        self.dispatcher.on_report(p.load())

    def on_token(self, sr: SimRequest) -> None:
        """A decode worker sampled a token of ``sr`` (its ``token_times`` has it)."""
        t = sr.token_times
        if len(t) == 1:  # prefilled locally: that was the first token
            self.dispatcher.on_first_token(sr.req.request_id, self.clock.now, t[0] - sr.arrival)

    def on_prefilled(self, p: SimWorker, sr: SimRequest) -> None:
        sr.token_times.append(self.clock.now)  # the first token leaves now (TTFT)
        self.dispatcher.on_first_token(sr.req.request_id, self.clock.now, self.clock.now - sr.arrival)
        sr.prefilled = True
        p.sending += 1
        p.changed()
        self.maybe_transfer(sr)

    def maybe_transfer(self, sr: SimRequest) -> None:
        if not (sr.prefilled and sr.reserved):
            return
        t = self.profile.transfer_time(sr.req.num_prompt_tokens)
        self.clock.at(self.clock.now + t, lambda: self._transferred(sr))

    def _transferred(self, sr: SimRequest) -> None:
        p, d = sr.prefill_worker, sr.decode_worker
        assert p is not None and d is not None
        p.sending -= 1
        p.kv.free(sr.req.request_id)
        p.requests.pop(sr.req.request_id, None)
        p.kick()
        d.admit_decode(sr)

    def finish(self, sr: SimRequest) -> None:
        sr.done = True
        self.finished.append(sr)
        t = sr.token_times
        gaps = [b - a for a, b in itertools.pairwise(t[1:])]  # without the hand-off gap
        self.dispatcher.on_end(sr.req.request_id, self.clock.now, statistics.median(gaps) if gaps else None)

    def finish_before_decode(self, sr: SimRequest) -> None:
        """Prefill's first token ended the request: decode gives its reservation back."""
        d = sr.decode_worker
        assert d is not None
        if sr.reserved:
            d.kv.free(sr.req.request_id)
            d.try_reserve()
        elif sr in d.reservations:
            d.reservations.remove(sr)
        d.changed()
        self.finish(sr)

    def run(self) -> None:
        self.clock.run()
        for w in self.by_id.values():  # every scenario ends with every block back
            stats = w.kv.check_integrity()
            if stats.used:
                raise AssertionError(f"{w.wid}: {stats.used} KV blocks still used after the run")
