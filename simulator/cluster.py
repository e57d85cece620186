"""The simulated cluster: the real role engines on a virtual clock (each a ``SimWorker``,
``pdserve.simulator.sim_worker``), a router that dispatches.

The router side has no request flow of its own: each request's attempt is the router's state
machine (``pdserve.router.lifecycle``), driven here on the virtual clock — its commands reach
the engines through their roles' handler tables, as in a worker process, and their answers,
the workers' deltas, lost workers and the end go back to it. This module only routes (the
router's real dispatcher, with the same feedback: first token, end, load reports, the
workers' prefix-cache events), carries
out the machine's effects, moves requests the router's way (a prompt given back when the
prefill pool changes, a worker lost), and measures what a client would. Rejected requests
end at once as failures. Every sampled token is a fixed id and every request ignores EOS:
lengths come from the workload.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.router.config import RouterConfig
from pdserve.router.lifecycle import (
    Attempt,
    Deliver,
    Effect,
    Fail,
    Failure,
    Relocate,
    Send,
    Timeouts,
    failure_of,
    why_not_migrate,
)
from pdserve.router.policy import Dispatcher, Outcome, RouteRequest
from pdserve.router.rebalance import Waiting, queue_of, withdrawals
from pdserve.router.slo import SloClass
from pdserve.simulator.calibration import calibration_of
from pdserve.simulator.early_stop import EarlyStop
from pdserve.simulator.jitter import StepJitter
from pdserve.simulator.prompt_memo import prompt_keys
from pdserve.simulator.replicas import ReplicaDraw
from pdserve.simulator.sim_request import SimRequest
from pdserve.simulator.sim_worker import SimWorker
from pdserve.simulator.virtual import TOKEN, Clock, Link
from pdserve.steptime.model import StepTimeModel
from pdserve.worker.commands import Answer, Withdraw
from pdserve.worker.messages import KvEvents, PlacedWork, TokenDelta, WorkerRole, WorkItem

_RECHECK_S = 1e-9  # a deadline is judged this long after it falls, clear of rounding


class Cluster:
    def __init__(
        self,
        profile: StepTimeModel,
        prefill: int,
        decode: int,
        colocated: int,
        dispatcher: Dispatcher | Sequence[Dispatcher],
        prefill_config: SchedulerConfig,
        decode_config: SchedulerConfig,
        block_size: int = 16,
        slo: SloClass | None = None,
        shared_host: bool = False,
        jitter_seed: int = 0,
        reserve_timeout_s: float = RouterConfig.reserve_timeout_s,
        rebalance_prefill: bool = RouterConfig.rebalance_prefill,
        fast_steps: bool = True,
        migration_limit: int = RouterConfig.migration_limit,
        prefill_profile: StepTimeModel | None = None,
        replica_seed: int = 0,
    ) -> None:
        """``dispatcher``: the router's, or one per router replica (``pdserve.simulator.replicas``:
        each request lands on one, drawn with ``replica_seed``)."""
        if not (reserve_timeout_s > 0 and math.isfinite(reserve_timeout_s)):
            raise ValueError(
                f"the reservation deadline (--reserve-timeout-s) must be finite and > 0, "
                f"got {reserve_timeout_s}"
            )
        self.clock = Clock()
        self.dispatchers = [dispatcher] if not isinstance(dispatcher, Sequence) else list(dispatcher)
        self.dispatcher = self.dispatchers[0]  # (the first replica's: one router's)
        self.routers = len(self.dispatchers)
        self._replica = ReplicaDraw(self.routers, replica_seed)
        # decode-only steps applied to the engines' state directly (simulator/fast_step.py):
        # the same run, several times faster; False steps every engine itself (the reference)
        self.fast_steps = fast_steps
        # as the router: a request whose decode worker finds no KV room in this long fails
        # (RESOURCE_EXHAUSTED) rather than waiting on
        self.reserve_timeout_s = reserve_timeout_s
        self.rebalance_prefill = rebalance_prefill
        self.rerouted = 0  # prompts taken back from a prefill worker and routed again
        self.timeouts = Timeouts(RouterConfig.call_timeout_s, reserve_timeout_s)
        self.migration_limit = migration_limit
        self.on_send: Callable[[Send], None] | None = None  # every command sent (tests read them)
        self.profile = profile  # decode workers' and colocated engines'
        # prefill workers' (another tensor-parallel degree: its own step times and KV pool)
        self.prefill_profile = prefill_profile or profile
        self.calibration = calibration_of(profile)
        self.link = Link(self.clock, profile)
        self.shared_host = shared_host
        self.jitter_seed = jitter_seed
        self.block_size = block_size
        self.configs = {WorkerRole.PREFILL: prefill_config, WorkerRole.DECODE: decode_config,
                        WorkerRole.COLOCATED: decode_config}  # fmt: skip
        self._ids = itertools.count()
        self.by_id: dict[str, SimWorker] = {}  # every worker ever started (the leak check reads all)
        self.prefillers: list[SimWorker] = []  # routable now
        self.decoders: list[SimWorker] = []
        self.lifetimes: dict[str, list[float]] = {}  # worker id -> [started, stopped (or open)]
        self.requests: dict[str, SimRequest] = {}  # in flight
        if colocated:
            for _ in range(colocated):
                self.add_worker(WorkerRole.COLOCATED)
        else:
            for _ in range(prefill):
                self.add_worker(WorkerRole.PREFILL)
            for _ in range(decode):
                self.add_worker(WorkerRole.DECODE)
        self.slo = slo
        self.finished: list[SimRequest] = []  # in the order they ended
        self.end_times: list[float] = []  # when each of ``finished`` ended (non-decreasing)
        self.decisions: dict[str, int] = {}  # "outcome/reason" -> count
        self.early_stop: EarlyStop | None = None  # set: end the run once the point cannot pass

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

    # -- membership ------------------------------------------------------------------------------
    def pool(self, role: WorkerRole) -> list[SimWorker]:
        return self.prefillers if role is WorkerRole.PREFILL else self.decoders

    def add_worker(self, role: WorkerRole, ready_in_s: float = 0.0) -> SimWorker:
        """Start a worker; it takes requests ``ready_in_s`` from now (its start-up: a GPU is
        held, and counted, from now)."""
        profile = self.prefill_profile if role is WorkerRole.PREFILL else self.profile
        w = SimWorker(f"{role.value}-{next(self._ids)}", role, profile, self.configs[role],
                      self.block_size, self)  # fmt: skip
        self.by_id[w.wid] = w
        self.lifetimes[w.wid] = [self.clock.now, math.inf]
        if ready_in_s > 0:
            self.clock.at(self.clock.now + ready_in_s, lambda: self._join(w))
        else:
            self._join(w)
        return w

    def _join(self, w: SimWorker) -> None:
        self.pool(w.role).append(w)
        if w.role is WorkerRole.PREFILL:
            self._rebalance_prefill()

    def retire(self, w: SimWorker, then: Callable[[], None] | None = None) -> None:
        """Route nothing new to ``w``; once it holds nothing, stop it (or run ``then``)."""
        self.pool(w.role).remove(w)
        w.retiring = True
        if w.role is WorkerRole.PREFILL:
            self._rebalance_prefill()

        def idle() -> None:
            if then is not None:
                then()
            else:
                self.lifetimes[w.wid][1] = self.clock.now

        w.on_idle = idle
        w._check_idle()

    def switch(
        self, w: SimWorker, role: WorkerRole, switch_s: float, on_join: Callable[[], object] | None = None
    ) -> None:
        """Drain ``w``, then run it as ``role`` (same KV pool) after ``switch_s``."""
        if self.prefill_profile is not self.profile:
            raise ValueError("a worker does not switch between pools of different tensor-parallel degrees")

        def swap() -> None:
            def join() -> None:
                w.become(role, self.configs[role])
                w.retiring = False
                self._join(w)
                if on_join is not None:
                    on_join()

            self.clock.at(self.clock.now + switch_s, join)

        self.retire(w, then=swap)

    def worker_seconds(self, until: float) -> float:
        return sum(min(end, until) - start for start, end in self.lifetimes.values() if start < until)

    def submit(self, arrival: float, rid: str, prompt: tuple[int, ...], output_len: int) -> SimRequest:
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        sr = SimRequest(WorkItem(rid, prompt, params), arrival, replica=self._replica())
        self.clock.at(arrival, lambda: self._arrive(sr))
        return sr

    # -- the router ------------------------------------------------------------------------------
    def _arrive(self, sr: SimRequest, avoid: SimWorker | None = None) -> None:
        """Route ``sr`` (again, after a prefill worker gave it back: not to ``avoid``; after a
        lost worker, as the router routes a moved request)."""
        work = sr.work
        rid = work.request_id
        sr.dispatched = self.clock.now
        sent = work.output_token_ids
        # (the prompt itself unless tokens were sent: its keys are remembered by its identity)
        context = work.prompt_token_ids + sent if sent else work.prompt_token_ids
        remaining = work.params.max_tokens - len(sent)
        route = RouteRequest(
            len(context), remaining, request_id=rid, slo=self.slo,
            block_keys=prompt_keys(context, self.block_size),
        )  # fmt: skip
        # tokens already sent are recomputed where decoding goes on (the router's rule)
        r = sr.replica
        prefill = (
            [w.load_for(r) for w in self.prefillers if w is not avoid] if not work.output_token_ids else []
        )
        dispatcher = self.dispatchers[r]
        decision = dispatcher.decide(route, prefill, [w.load_for(r) for w in self.decoders], self.clock.now)
        if avoid is None and not sr.attempts:
            key = f"{decision.outcome.value}/{decision.reason}"
            self.decisions[key] = self.decisions.get(key, 0) + 1
        if decision.outcome is Outcome.REJECTED and not sr.attempts:
            sr.rejected = True
            self.finish(sr)
            return
        # (a prompt routed again was admitted already: as the router, it goes to the pair the
        # dispatcher named even when it predicts it late)
        if decision.priority:
            sr.work = work = replace(work, priority=decision.priority)
        self.requests[rid] = sr
        attempt = Attempt(work, decision.decode_worker, decision.prefill_worker, self.timeouts)
        sr.attempt = attempt
        d = sr.decode_worker = self.by_id[attempt.decode]
        p = sr.prefill_worker = self.by_id[attempt.prefill] if attempt.prefill is not None else None
        if p is not None:
            self.link.tokens[attempt.transfer_id] = sr.num_prompt_tokens
        self._apply(sr, attempt, attempt.dispatch())
        for i, each in enumerate(self.dispatchers):  # every replica hears every worker
            each.on_report(d.load_for(i))  # simulated loads are always fresh
            if p is not None:
                each.on_report(p.load_for(i))

    def _apply(self, sr: SimRequest, attempt: Attempt, effects: list[Effect]) -> None:
        """Carry out what ``attempt`` decided, as the router's driver does (``Hold``, ``Drop``,
        ``TakenIn`` and ``Reserved`` are the router's bookkeeping: the engines are the truth here)."""
        for e in effects:
            if isinstance(e, Send):
                self._send(sr, attempt, e)
            elif isinstance(e, Deliver):
                self._deliver(sr, self.by_id[e.worker], e.delta)
            elif isinstance(e, Fail):
                sr.error = f"{e.code.name}: {e.message}"
                self.finish(sr)
            elif isinstance(e, Relocate):
                self._relocate(sr, e.why)

    def _send(self, sr: SimRequest, attempt: Attempt, sent: Send) -> None:
        w = self.by_id[sent.worker]
        if w.lost:  # a gone worker frees nothing; a command that mattered fails as its loss
            if not sent.quiet:
                why = f"worker {w.wid} is unavailable"
                self._apply(sr, attempt, attempt.call_failed(sent, Failure.LOST, why))
            return
        if self.on_send is not None:
            self.on_send(sent)
        try:
            answer = w.execute(sent.command, sr.replica)
        except Exception as e:
            failure, message, field = failure_of(e)
            if failure is Failure.INTERNAL:
                raise  # the simulator's own fault, not the request's
            self._apply(sr, attempt, attempt.call_failed(sent, failure, message, field))
            return
        if isinstance(answer, Future):
            if not answer.done():  # settles in a step of ``w``: the router hears at its end
                answer.add_done_callback(lambda f: w.later(lambda: self._answered(sr, attempt, sent, f)))
                return
            answer = answer.result()
        self._apply(sr, attempt, attempt.answered(sent, answer))

    def _answered(self, sr: SimRequest, attempt: Attempt, sent: Send, fut: Future[Answer]) -> None:
        self._apply(sr, attempt, attempt.answered(sent, fut.result()))

    def _deliver(self, sr: SimRequest, w: SimWorker, delta: TokenDelta) -> None:
        """A delta for the client: its tokens leave now."""
        now = self.clock.now
        if w is sr.prefill_worker:
            sr.token_times.append(now)  # the first token leaves now (TTFT)
            self._first_token(sr, delta.num_cached_tokens)
            if delta.finished:  # that token was the last
                self.finish(sr)
            return
        if not delta.token_ids and not delta.finished:
            return
        first = not sr.token_times
        sr.token_times.extend([now] * len(delta.token_ids))
        if first and sr.token_times:  # prefilled locally: that was the first token
            self._first_token(sr, delta.num_cached_tokens)
        if delta.finished:
            self.finish(sr)

    def on_kv_events(self, w: SimWorker, events: KvEvents) -> None:
        """What ``w``'s prefix cache stored and evicted: every router replica's prefix index
        learns it (a worker sends its events to every router)."""
        for dispatcher in self.dispatchers:
            dispatcher.on_kv_events(w.wid, events)

    def on_delta(self, w: SimWorker, delta: TokenDelta) -> None:
        sr = self.requests.get(delta.request_id)
        if sr is None or sr.attempt is None or w.lost:
            return
        if delta.error:
            raise AssertionError(f"{w.wid} failed {delta.request_id}: {delta.error}")
        if sr.attempt.steady(w.wid, delta):
            self._deliver(sr, w, delta)
        else:
            self._apply(sr, sr.attempt, sr.attempt.on_delta(w.wid, delta))

    def on_tokens(self, w: SimWorker, rows: list[Request], finished: list[Request]) -> None:
        """A steady step's tokens, one per row (``pdserve.simulator.fast_step``), those of
        ``finished`` their last: what ``on_delta`` does with each row's one-token delta."""
        if w.lost:
            return
        now = self.clock.now
        for req in rows:
            sr = self.requests.get(req.request_id)
            if sr is None:
                continue
            first = not sr.token_times
            sr.token_times.append(now)
            if first:  # prefilled locally: that was the first token
                self._first_token(sr, req.num_cached_tokens)
            if finished and req in finished:
                assert sr.attempt is not None
                self._apply(sr, sr.attempt, sr.attempt.forget(w.wid))  # decode let go of it
                self.finish(sr)

    def _first_token(self, sr: SimRequest, cached: int) -> None:
        """``sr``'s first token left now: the router's feedback, and the early stop's verdict."""
        now = self.clock.now
        sr.cached = cached
        self.dispatchers[sr.replica].on_first_token(sr.work.request_id, now, now - sr.dispatched)
        self._judge(lambda es: es.first_token(sr.key, now - sr.arrival))
        es = self.early_stop
        params = sr.work.params
        ends_at_length = params.ignore_eos and not params.stop_token_ids  # all its tokens come
        if es is not None and es.slo.tpot_ms and params.max_tokens >= 2 and ends_at_length:
            # its TPOT, (last token - first) / (tokens - 1), passes the target once even a last
            # token at once would leave it over: the verdict need not wait for the last token
            n, t1 = params.max_tokens - 1, sr.token_times[0]
            self._due(t1 + es.slo.tpot_ms / 1000 * n, sr, es.slo.tpot_ms, ttft=t1 - sr.arrival, per=n)

    def watch_deadlines(self, tracked: list[SimRequest]) -> None:
        """With an early stop: judge a request as soon as it certainly misses, not only when its
        first or last token comes: once it has waited past the TTFT target without a first token
        (or past the end-to-end target unfinished), and once its TPOT is past the target however
        soon the rest of its tokens come. Each verdict is the one its tokens would give: a TTFT,
        TPOT or latency computed as ``RequestResult`` computes it, with now in place of a token
        time still to come (later, so never smaller)."""
        es = self.early_stop
        assert es is not None
        slo = es.slo
        for sr in tracked:
            if slo.ttft_ms:
                self._due(sr.arrival + slo.ttft_ms / 1000, sr, slo.ttft_ms, first=True)
            if slo.e2el_ms:
                self._due(sr.arrival + slo.e2el_ms / 1000, sr, slo.e2el_ms)

    def _due(
        self,
        at: float,
        sr: SimRequest,
        target_ms: float,
        first: bool = False,
        ttft: float = 0.0,
        per: int = 1,
    ) -> None:
        """At ``at`` (or just after: until it is past ``target_ms``), count ``sr`` a miss unless
        it has finished (or, ``first``, has its first token): its latency so far, less ``ttft``,
        over ``per`` tokens (a TTFT or latency: 0 and 1; a TPOT: the TTFT and tokens - 1)."""

        def check() -> None:
            if sr.done or (first and sr.token_times):
                return
            if ((self.clock.now - sr.arrival) - ttft) / per * 1000 > target_ms:
                self._judge(lambda es: es.missed(sr.key))
            else:  # rounding landed it a hair short of the target: look again a moment later
                self.clock.at(self.clock.now + _RECHECK_S, check)

        self.clock.at(at + _RECHECK_S, check)

    def _rebalance_prefill(self) -> None:
        """As the router does when the prefill pool changes: take back the prompts that have not
        started (``pdserve.router.rebalance``) and route them again under a fresh id (each router
        replica its own prompts)."""
        for replica in range(self.routers):
            self._rebalance_own(replica)

    def _rebalance_own(self, replica: int) -> None:
        if not self.rebalance_prefill or not self.requests:
            return
        ttft_ms = self.slo.ttft_ms if self.slo is not None else 0.0
        holders: dict[str, list[Waiting]] = {}
        for sr in self.requests.values():
            p = sr.prefill_worker
            if (
                p is not None
                and not sr.token_times
                and p.role is WorkerRole.PREFILL
                and sr.replica == replica
            ):
                waiting = Waiting(
                    sr.work.request_id, sr.dispatched, sr.arrival, sr.num_prompt_tokens, ttft_ms
                )
                holders.setdefault(p.wid, []).append(waiting)
        queues = {wid: queue_of(q, self.clock.now) for wid, q in holders.items()}
        budget = self.configs[WorkerRole.PREFILL].max_num_batched_tokens
        plan = withdrawals(queues, [w.wid for w in self.prefillers], budget)
        for wid, rids in plan.items():
            p = self.by_id[wid]
            taken = [rid for rid in rids if p.execute(Withdraw(rid), replica) is True]
            for rid in reversed(taken):  # oldest first, as they came
                self._reroute(self.requests[rid], p)
            p.changed()
            p._check_idle()

    def _reroute(self, sr: SimRequest, avoid: SimWorker) -> None:
        """A prefill worker gave the prompt back: route it again, not to ``avoid``."""
        assert sr.attempt is not None
        self._apply(sr, sr.attempt, sr.attempt.forget(avoid.wid))
        self.rerouted += 1
        self._restart(sr, avoid)

    def _restart(self, sr: SimRequest, avoid: SimWorker | None = None) -> None:
        """As the router restarts a request: the attempt under way lets go of it everywhere,
        and it is routed again under a fresh id, with the tokens already sent."""
        attempt = sr.attempt
        assert attempt is not None
        old = attempt.request_id
        self._apply(sr, attempt, attempt.end())  # its reservation goes back
        self.link.tokens.pop(attempt.transfer_id, None)
        self.dispatchers[sr.replica].on_end(old, self.clock.now, None)  # forget the old placement
        del self.requests[old]
        sr.attempts += 1
        base = old.split("~", 1)[0]
        sent = (TOKEN,) * len(sr.token_times)  # every sampled token is the same id
        sr.work = replace(sr.work, request_id=f"{base}~{sr.attempts}", output_token_ids=sent)
        sr.prefill_worker = sr.decode_worker = sr.attempt = None
        self._arrive(sr, avoid)

    # -- lost workers ----------------------------------------------------------------------------
    def lose(self, w: SimWorker) -> None:
        """``w`` fails now: as the router handles a lost worker, whatever it held moves to
        other workers (or fails), and a decode worker holding a first token recomputes."""
        if w.lost:
            return
        w.lost = True
        if w in self.pool(w.role):
            self.pool(w.role).remove(w)
        self.lifetimes[w.wid][1] = self.clock.now
        for dispatcher in self.dispatchers:
            dispatcher.on_worker_lost(w.wid)
        for sr in list(self.requests.values()):
            a = sr.attempt
            if a is not None and w.wid in a.holders and not sr.done:
                self._apply(sr, a, a.worker_lost(w.wid))

    def abort(self, sr: SimRequest) -> None:
        """``sr``'s client leaves now: as the router ends a cancelled request."""
        if not sr.done:
            sr.error = "CANCELLED: the client left"
            self.finish(sr)

    def _relocate(self, sr: SimRequest, why: str) -> None:
        """As the router moves a request off a lost worker, or fails it (``why_not_migrate``)."""
        why_not = why_not_migrate(sr.fault_migrations, self.migration_limit, bool(self.decoders))
        if why_not is not None:
            sr.error = f"UNAVAILABLE: {why}; {why_not}"
            self.finish(sr)
            return
        sr.fault_migrations += 1
        self._restart(sr)

    def _judge(self, verdict: Callable[[EarlyStop], bool]) -> None:
        if self.early_stop is not None and verdict(self.early_stop):
            self.clock.stop()

    def finish(self, sr: SimRequest) -> None:
        if sr.done:
            return
        sr.done = True
        self._judge(lambda es: es.failed(sr.key) if sr.rejected else es.finished(sr.key, sr.result()))
        self.requests.pop(sr.work.request_id, None)
        if sr.attempt is not None:
            self.link.tokens.pop(sr.attempt.transfer_id, None)
            self._apply(sr, sr.attempt, sr.attempt.end())  # the workers still holding it let go
        self.finished.append(sr)
        self.end_times.append(self.clock.now)
        t = sr.token_times
        gaps = [b - a for a, b in itertools.pairwise(t[1:])]  # without the hand-off gap
        median = statistics.median(gaps) if gaps else None
        self.dispatchers[sr.replica].on_end(sr.work.request_id, self.clock.now, median)

    def run(self) -> None:
        self.clock.run()
        for w in self.by_id.values():  # decode runs cut short by an early stop: their state as of it
            w.settle()
        if self.clock.stopped:  # ended early: requests are in flight by design
            return
        for w in self.by_id.values():  # every scenario ends with every request done and nothing held
            if w.lost:
                continue  # (its state went with it)
            if not w.engine.idle:
                held = {k: v for k, v in w.engine.request_state().items() if v}
                raise AssertionError(f"{w.wid}: requests left after the run: {held}")
            try:
                w.engine.check_integrity()
            except AssertionError as e:
                raise AssertionError(f"{w.wid}: {e}") from None
            left = w.reports.owners.total() if w.reports is not None else None
            if left is not None and left != PlacedWork():  # (handed-off prompts carry no work)
                raise AssertionError(f"{w.wid}: its owners' accounts hold work after the run: {left}")
