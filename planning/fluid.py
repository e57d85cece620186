"""A request-level model of the disaggregated cluster, for days of traffic at tens of GPUs.

The event simulator (``pdserve.simulator.cluster``) runs the product's engines step by step,
about 2.5 ms of CPU a request: an hour at the hundreds of requests a second that 64 GPUs serve
is hours of CPU. This model keeps its physics (the same step-time model, router choices and
deadlines) but moves whole requests, and decode by the tick rather than by the step:

- **router**: an arrival goes to the prefill worker whose next joinable step starts first and
  reserves ``prompt + output`` tokens of KV on the routable decode worker holding the fewest;
  with ``reject`` it is refused at once (a miss) when the router's predicted TTFT (its queue
  rule, scaled by its online correction) or predicted TPOT (the decode worker's step with it
  in the batch, plus the hand-off and any wait for KV room spread over its tokens) is over
  the target — the goodput router's test, without its harm term;
- **prefill**: each worker runs batched steps back to back; an arrival joins the step that
  starts next (up to ``step_tokens``; a longer prompt is a step of its own) and its first
  token leaves at that step's end (``StepTimeModel.step_time`` of the step's prompts);
- **decode**: a request joins its worker one hand-off (``transfer_time``) after both its first
  token and its reservation, when the worker runs fewer than ``max_seqs``; every tick each
  worker's batch advances ``tick / decode_time(B, Σ context)`` tokens a request (finishing
  times interpolated inside the tick), contexts growing as they decode;
- **KV**: a reservation without room waits on its worker first come first served and fails
  (RESOURCE_EXHAUSTED, a miss) after ``reserve_timeout_s``, as the router fails it;
- **pools**: a started worker holds its GPU at once and serves ``start_s`` later; a retired one
  takes nothing new and stops when its work is done (a prefill worker once its prompts' KV has
  reached their decode workers); a switched one drains, then serves in the other pool
  ``switch_s`` later.

Not modelled: prefix caching, local prefill on decode workers (conditional disaggregation),
colocated layouts, the prefill workers' own KV pool filling up while decode has no room (the
event simulator's back-pressure: with too few decode workers for the load this model is a
few points optimistic), step-time jitter and shared-host slow-downs.

A request is good when it was served with TTFT and TPOT (first to last token over the tokens
after the first, the hand-off included, as ``pdserve bench`` measures) within the targets.
``benchmarks/autoscale_day.py`` checks the model against the event simulator at the scale
the latter can run.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

import numpy as np

from pdserve.planning.fluid_data import Arrivals, Ended, FluidConfig, Role
from pdserve.planning.fluid_decode import RunningDecode
from pdserve.planning.fluid_records import FluidRequest, FluidWorker, WorkerState
from pdserve.steptime.model import StepTimeModel


class FluidCluster:
    def __init__(self, model: StepTimeModel, prefill: int, decode: int, config: FluidConfig) -> None:
        if prefill < 1 or decode < 1:
            raise ValueError("the fluid model runs disaggregated layouts: at least 1P+1D")
        self.model = model
        self.config = config
        # a prompt's prefill and hand-off times, by length (a trace holds a few thousand lengths)
        self._prefill_memo: dict[int, float] = {}
        self._transfer_memo: dict[int, float] = {}
        self.capacity = model.kv_capacity_tokens
        self.now = 0.0
        self.workers: list[FluidWorker] = []  # every worker ever started (``index`` is the position)
        self.live: list[FluidWorker] = []  # those not stopped: what every tick walks
        self._seq = itertools.count()
        # prefill workers by their next joinable step's start (lazily: an entry is checked when
        # popped), one entry a worker, tagged with the worker's ``gen`` of the time it joined
        self._heap: list[tuple[float, int, FluidWorker]] = []
        self._joining: list[tuple[float, int, FluidRequest]] = []  # (join time, seq, request)
        self.decoding = RunningDecode(model, config)  # requests past their hand-off
        self._ended: list[Ended] = []
        self._pending: list[tuple[float, float, float, bool, float]] = []  # this tick's ends, as rows
        self.offered = self.ended = self.good = self.rejected = self.failed = 0
        # The router's prefill correction (``StepPredictor``, one for the pool here, one a worker
        # there): each first token moves it a fifth of the way to observed / predicted TTFT,
        # the prediction before the correction. The router scales each job's compute by it, so
        # the queue ahead too; here the whole prediction
        self.ttft_factor, self._ttft_samples = 1.0, 0
        self._mean_out = 200.0  # the arrivals' mean output, drifting toward the workload's
        self.last_join = -math.inf  # the last worker that joined a pool after the start
        self.last_leave = -math.inf  # the last worker retired (no new requests from then)
        # each tick's arrivals (tick end, Σoutput, their prompt lengths), for a planner's windows:
        # kept only when one reads (and trims) it
        self.log_arrivals = False
        self.arrival_log: deque[tuple[float, float, np.ndarray]] = deque()
        for role, n in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            for _ in range(n):
                self.add_worker(role, ready_in_s=0.0)
        self._promote(0.0)
        self.last_join = -math.inf

    def _prefill_s(self, tokens: int) -> float:
        t = self._prefill_memo.get(tokens)
        if t is None:
            t = self._prefill_memo[tokens] = self.model.prefill_time(tokens)
        return t

    def _transfer_s(self, tokens: int) -> float:
        t = self._transfer_memo.get(tokens)
        if t is None:
            t = self._transfer_memo[tokens] = self.model.transfer_time(tokens)
        return t

    # -- pools -----------------------------------------------------------------------------------
    def add_worker(self, role: Role, ready_in_s: float) -> FluidWorker:
        w = FluidWorker(len(self.workers), role, self.now, self.now + ready_in_s)
        self.workers.append(w)
        self.live.append(w)
        return w

    def pool(self, role: Role, states: tuple[WorkerState, ...] = (WorkerState.SERVING,)) -> list[FluidWorker]:
        return [w for w in self.live if w.role is role and w.state in states]

    def counts(self) -> tuple[int, int]:
        """Workers serving or starting by pool (a switching one in its new pool)."""
        n = {Role.PREFILL: 0, Role.DECODE: 0}
        for w in self.live:
            if w.state is WorkerState.STOPPED or (w.state is WorkerState.DRAINING and w.switch_to is None):
                continue
            n[w.switch_to or w.role] += 1
        return n[Role.PREFILL], n[Role.DECODE]

    @property
    def layout_since(self) -> float:
        """When the serving workers last changed (a join or a retirement): requests that arrived
        from then on were routed over the present layout alone."""
        return max(self.last_join, self.last_leave)

    def starting(self) -> bool:
        return any(w.state is WorkerState.STARTING or w.switch_to is not None for w in self.live)

    def idlest(self, role: Role) -> FluidWorker:
        pool = self.pool(role)
        if role is Role.PREFILL:
            return min(pool, key=lambda w: (w.open_end if w.members else w.end, w.index))
        return min(pool, key=lambda w: (w.held, w.index))

    def retire(self, w: FluidWorker, switch_to: Role | None = None) -> None:
        """Stop routing to ``w``; it stops (or, ``switch_to``, changes pool) when drained."""
        if w.state is not WorkerState.SERVING:
            raise ValueError(f"worker {w.index} is {w.state.value}, not serving")
        w.state = WorkerState.DRAINING
        w.switch_to = switch_to
        w.retired_at = self.now
        self.last_leave = max(self.last_leave, self.now)
        w.gen = -1  # its prefill heap entry, if any, is void
        if w.role is Role.PREFILL and w.members:
            self._close(w)

    def _drained(self, w: FluidWorker, t: float, switch_s: float) -> None:
        if w.switch_to is None:
            w.state, w.stopped_at = WorkerState.STOPPED, t
            self.live.remove(w)
            return
        w.role, w.switch_to, w.state = w.switch_to, None, WorkerState.STARTING
        w.ready_at = w.end = t + switch_s

    def _promote(self, t: float) -> None:
        """Workers whose start-up ended by ``t`` begin serving."""
        for w in self.live:
            if w.state is WorkerState.STARTING and w.ready_at <= t:
                w.state = WorkerState.SERVING
                self.last_join = max(self.last_join, t)
                if w.role is Role.PREFILL:
                    w.gen = next(self._seq)
                    heapq.heappush(self._heap, (w.ready_at, w.gen, w))

    def worker_seconds(self, until: float) -> float:
        return sum(
            min(until, until if math.isnan(w.stopped_at) else w.stopped_at) - w.held_from
            for w in self.workers
            if w.held_from < until
        )

    # -- prefill ---------------------------------------------------------------------------------
    def _close(self, w: FluidWorker) -> None:
        """The open step is final: its prompts' first tokens leave at its end."""
        w.closed.append((w.open_start, w.open_end, w.open_tokens))
        w.closed_tokens += w.open_tokens
        members, w.members, w.open_lens, w.open_tokens, w.end = w.members, [], [], 0, w.open_end
        for r in members:
            r.first = w.end
            self._prefilled(r)

    def _settle(self, w: FluidWorker, t: float) -> float:
        """``w``'s key: when its queued prompts are done (its open step closed first if it has
        started or is full: nothing joins it any more). An idle worker's is its last step's
        end, in the past: the idle are all free now, in any order."""
        if w.members and (w.open_start <= t or w.open_tokens >= self.config.step_tokens):
            self._close(w)
        return w.open_end if w.members else w.end

    def _predict(self, w: FluidWorker, t: float, prompt: int) -> float:
        """The TTFT the goodput router predicts on ``w`` (``GoodputPolicy._prefill_candidates``,
        before its correction): the work queued ahead and the prompt's own prefill; with tokens
        queued, at least as many full steps as they and the prompt fill, counted from when the
        running step began. Its rejections follow from this, not from the model's own (more
        exact) first-token time, which is what the prompt then gets."""
        while w.closed and w.closed[0][1] <= t:
            w.closed_tokens -= w.closed.popleft()[2]
        queued = w.closed_tokens + w.open_tokens
        own = self._prefill_s(prompt)
        if not queued:
            return own
        busy_since = w.closed[0][0] if w.closed else min(t, w.open_start)
        free = w.open_end if w.members else w.end
        budget = self.config.step_tokens
        steps = math.ceil((queued + prompt) / budget)
        full = self._prefill_s(min(budget, queued + prompt))
        return max(max(0.0, free - t) + own, steps * full - (t - busy_since))

    def _place(self, t: float, prompt: int) -> tuple[FluidWorker, float, float] | None:
        """The prefill worker whose queued prompts are done first (the least work, as the
        goodput router balances it); (worker, the start of the step the request joins, its
        first-token time there). None: no prefill worker is serving."""
        heap = self._heap
        while heap:
            key, gen, w = heapq.heappop(heap)
            if gen != w.gen or not w.routable or w.role is not Role.PREFILL:
                continue  # gone from the pool, or an entry from a previous time in it
            real = self._settle(w, t)
            if real > key and heap and heap[0][0] < real:
                heapq.heappush(heap, (real, w.gen, w))
                continue
            break
        else:
            return None
        if w.members and w.open_tokens + prompt <= self.config.step_tokens:
            lens = [(n, 0) for n in w.open_lens]
            lens.append((prompt, 0))
            return w, w.open_start, w.open_start + self.model.step_time(lens)
        if w.members:  # this prompt does not fit: it opens the step after
            self._close(w)
        start = max(t, w.end)
        return w, start, start + self._prefill_s(prompt)

    def _join_step(self, w: FluidWorker, start: float, first: float, r: FluidRequest) -> None:
        if not w.members:
            w.open_start = start
        w.open_lens.append(r.prompt)
        w.open_tokens += r.prompt
        w.members.append(r)
        w.open_end = first
        heapq.heappush(self._heap, (first, w.gen, w))

    # -- the router ------------------------------------------------------------------------------
    def _arrive(
        self,
        t: float,
        prompt: int,
        output: int,
        decoders: list[tuple[int, int, FluidWorker]],
        batch: dict[int, tuple[int, float]],
    ) -> None:
        c = self.config
        self.offered += 1
        placed = self._place(t, prompt) if decoders else None
        if placed is None:  # a pool with no worker serving (never so under the autoscaler)
            self._end(t, t, math.nan, math.nan, False)
            self.failed += 1
            return
        d = decoders[0][2]
        w, start, first = placed
        raw = self._predict(w, t, prompt)
        predicted = raw * self.ttft_factor
        self._mean_out += 0.01 * (output - self._mean_out)
        if c.reject:
            b, ctx = batch[d.index]
            step = self.model.decode_time(min(b + 1, c.max_seqs), round(ctx + prompt))
            gap = self._transfer_s(prompt) + self._room_wait(d, b, step, prompt + output)
            tpot = step + gap / max(1, output - 1)
            if (c.ttft_s and predicted > c.ttft_s) or (c.tpot_s and output > 1 and tpot > c.tpot_s):
                heapq.heappush(self._heap, (self._settle(w, t), w.gen, w))
                self.rejected += 1
                self._end(t, t, math.nan, math.nan, False)
                return
        r = FluidRequest(t, prompt, output, w, d)
        r.predicted = raw
        d.held += 1
        if d.reserved + r.kv <= self.capacity and not d.waiting:
            d.reserved += r.kv
            r.granted = t
        else:
            d.waiting.append(r)
            d.queued += r.kv
        heapq.heapreplace(decoders, (d.reserved + d.queued, decoders[0][1], d))
        self._join_step(w, start, first, r)
        b, ctx = batch[d.index]
        batch[d.index] = (b + 1, ctx + prompt)

    def _room_wait(self, d: FluidWorker, b: int, step: float, kv: int) -> float:
        """The router's predicted wait for KV room or a sequence slot on ``d`` (its batch ``b``
        finishing a request every ``mean output × step / b`` seconds, each giving back a
        request's worth of KV): it goes into the first token gap of the TPOT it checks."""
        every = self._mean_out * step / max(1, b)
        wait = 0.0
        free = self.capacity - d.reserved - d.queued
        if free < kv:
            wait += math.ceil((kv - free) / max(1, kv)) * every
        if b >= self.config.max_seqs:
            wait += (b - self.config.max_seqs + 1) * every
        return wait

    def _prefilled(self, r: FluidRequest) -> None:
        if r.predicted > 0:
            ratio = min(1e4, max(1e-3, (r.first - r.arrival) / r.predicted))
            self.ttft_factor = ratio if not self._ttft_samples else 0.8 * self.ttft_factor + 0.2 * ratio
            self._ttft_samples += 1
        if r.granted == math.inf:  # failed waiting for KV room: the prompt is let go
            return
        if r.output <= 1:  # its first token was its last: the reservation goes back
            self._release(r)
            self._end(r.first, r.arrival, r.first - r.arrival, 0.0, True)
            return
        r.prefill.sending += 1  # its KV stays on the prefill worker until it joins decode
        if not math.isnan(r.granted):
            self._joins(r)

    def _joins(self, r: FluidRequest) -> None:
        at = max(r.first, r.granted) + self._transfer_s(r.prompt)
        heapq.heappush(self._joining, (at, next(self._seq), r))

    def _release(self, r: FluidRequest) -> None:
        d = r.decode
        d.held -= 1
        if math.isnan(r.granted):
            d.waiting.remove(r)
            d.queued -= r.kv
        else:
            d.reserved -= r.kv

    def _end(self, at: float, arrival: float, ttft: float, tpot: float, served: bool) -> None:
        good = served and self.config.good(ttft, tpot)
        self.good += good
        self.ended += 1
        self._pending.append((at, ttft, tpot, good, arrival))

    # -- decode ---------------------------------------------------------------------------------
    def _decode(self, t0: float, t1: float) -> None:
        n = len(self.workers)
        joined: list[FluidRequest] = []
        joined_at: list[float] = []
        count = self.decoding.counts(n)
        later = []
        while self._joining and self._joining[0][0] < t1:
            at, seq, r = heapq.heappop(self._joining)
            if count[r.decode.index] >= self.config.max_seqs:
                later.append((t1, seq, r))  # no free sequence slot: it waits a tick
                continue
            count[r.decode.index] += 1
            r.prefill.sending -= 1
            joined.append(r)
            joined_at.append(at)
        for item in later:
            heapq.heappush(self._joining, item)
        self.decoding.add(joined, joined_at)
        finished = self.decoding.advance(t0, t1, n)
        if finished is None:
            return
        ended = finished.ended
        self.good += int(ended.good.sum())
        self.ended += len(ended.end)
        self._ended.append(ended)
        freed = np.bincount(finished.worker, weights=finished.kv, minlength=n)
        gone = np.bincount(finished.worker, minlength=n)
        for i in np.flatnonzero(gone):
            w = self.workers[i]
            w.reserved -= round(freed[i])
            w.held -= int(gone[i])

    def _grant(self, t: float) -> None:
        """Reservations waiting for room: granted in order while it lasts; failed past the
        router's deadline."""
        for d in self.live:
            while d.waiting:
                r = d.waiting[0]
                if d.reserved + r.kv <= self.capacity:
                    d.waiting.popleft()
                    d.queued -= r.kv
                    d.reserved += r.kv
                    r.granted = t
                    if not math.isnan(r.first):
                        self._joins(r)
                    continue
                break
            while d.waiting and t - d.waiting[0].arrival >= self.config.reserve_timeout_s:
                r = d.waiting.popleft()
                d.queued -= r.kv
                d.held -= 1
                if not math.isnan(r.first):  # prefilled: the prefill worker lets its KV go
                    r.prefill.sending -= 1
                r.granted = math.inf  # never joins (its first token may be out)
                self.failed += 1
                self._end(r.arrival + self.config.reserve_timeout_s, r.arrival, math.nan, math.nan, False)

    # -- the clock -------------------------------------------------------------------------------
    def tick(self, t1: float, arrivals: Arrivals) -> None:
        """Advance to ``t1`` with ``arrivals`` (all in ``[now, t1)``)."""
        t0 = self.now
        if not t1 > t0:
            raise ValueError(f"a tick must move the clock forward: {t0} -> {t1}")
        self._promote(t0)
        decoders = [(w.reserved + w.queued, w.index, w) for w in self.pool(Role.DECODE)]
        heapq.heapify(decoders)
        batch: dict[int, tuple[int, float]] = {}
        if len(self.decoding):
            b = self.decoding.counts(len(self.workers))
            ctx = self.decoding.contexts(len(self.workers))
            batch = {w.index: (int(b[w.index]), float(ctx[w.index])) for _, _, w in decoders}
        else:
            batch = {w.index: (0, 0.0) for _, _, w in decoders}
        n = len(arrivals.t)
        if n:
            arrive = self._arrive
            for t, p, o in zip(
                arrivals.t.tolist(), arrivals.prompt.tolist(), arrivals.output.tolist(), strict=True
            ):
                arrive(t, p, o, decoders, batch)
            if self.log_arrivals:
                self.arrival_log.append((t1, float(arrivals.output.sum()), arrivals.prompt))
        for w in self.live:  # steps started by t1 are final: their first tokens are known
            if w.role is Role.PREFILL and w.members and w.open_start <= t1:
                self._close(w)
        self._decode(t0, t1)
        self._grant(t1)
        if self._pending:
            rows = np.array(self._pending, dtype=np.float64)
            self._ended.append(Ended(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3].astype(bool), rows[:, 4]))
            self._pending = []
        self.now = t1

    def settle(self, switch_s: float) -> None:
        """Draining workers with nothing left stop or change pool."""
        for w in list(self.live):
            if w.state is not WorkerState.DRAINING:
                continue
            if w.role is Role.PREFILL and not w.members and not w.sending and w.end <= self.now:
                self._drained(w, max(w.end, w.retired_at), switch_s)
            elif w.role is Role.DECODE and w.held == 0:
                self._drained(w, self.now, switch_s)

    @property
    def busy(self) -> bool:
        return bool(self._joining or len(self.decoding) or any(w.members or w.held for w in self.live))

    def request_state(self) -> dict[str, int]:
        """Per-request state still held anywhere: all zero once every request has ended."""
        return {
            "in_flight": self.offered - self.ended,
            "prefill_queued": sum(len(w.members) for w in self.workers),
            "decode_held": sum(w.held for w in self.workers),
            "kv_reserved_tokens": sum(w.reserved for w in self.workers),
            "kv_waiting": sum(len(w.waiting) + w.queued for w in self.workers),
            "kv_sending": sum(w.sending for w in self.workers),
            "joining": len(self._joining),
            "running": len(self.decoding),
        }

    def take_ended(self) -> list[Ended]:
        out, self._ended = self._ended, []
        return out
