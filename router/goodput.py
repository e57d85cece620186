"""The ``goodput`` dispatcher: route each request where it is predicted to meet its SLO without
costing others theirs; refuse it early when nowhere can (pure Python).

For every option — each decode worker ``d`` paired with a prefill worker ``p``, or ``d`` alone
prefilling locally (conditional disaggregation) — it predicts, from ``StepPredictor`` and its own
``Ledger`` of placed work (with router replicas, plus what the others placed, which each worker
reports: ``pdserve.router.worker_view``):

- TTFT: the prefill queue ahead of the request on ``p`` (or on ``d``) plus its own prefill,
  less what the worker's cache holds (``PrefixIndex``, learnt from the workers' own
  events). In this design the first token leaves the prefill worker, so the KV transfer is
  not on the TTFT path;
- TPOT on ``d``: its decode step with the request in the batch, stretched by the share of
  ``d``'s recent time that went to local prefills (``step / (1 - share)``: those steps emit no
  token for the batch), plus, for a remote prefill, the KV hand-off over the ``p -> d`` link
  spread over the request's tokens (the hand-off is its first token gap);
- room: when ``d`` already queues requests (no KV room or sequence slot), the wait for a slot
  to free, added to a local prefill's TTFT or a remote one's first gap;
- harm: the requests already on ``d`` whose TPOT target that stretched step would miss.

Options are ranked by (requests newly meeting their SLO minus requests it makes miss, -risk,
cached prefix tokens, -cost). Risk is how close the option runs to the targets it touches:
the largest, then the sum, of predicted/target for the request's TTFT and TPOT and for the
tightest TPOT target already on ``d`` — so load spreads before anything misses, and a prefill
worker's queue, a slow link or a decode worker busy with local prefills all weigh in the same
currency. A short prompt rides in a memory-bound decode step almost for free (it barely
stretches ``d``'s step), so it stays local; a long one would take a visible share of ``d``'s
time, so it goes to a prefill worker unless the prefill queue or the link costs more. The cost
(request-seconds added: own TTFT, hand-off and decode steps, and the slower step every request
already on ``d`` takes) breaks the remaining ties, e.g. for requests without targets.

The step model does not let a prefill chunk hide under the decodes riding with it: the
profile charges the chunk's attention on top of the shared GEMMs (``pdserve.steptime.roofline``).

Local prefill needs a TPOT target to weigh: with none on the request nor on ``d``'s batch
(e.g. no SLO class configured), nothing prices the stall a local prompt puts into every stream
on ``d``, so with prefill workers up the request goes to one of them; a deployment never turns
colocated for want of targets.

Admission: when the best option does not meet the request's SLO (or meets it only by making
others miss theirs), its class decides: ``reject`` (a REJECTED decision with a retry hint),
``best-effort`` (placed at the lowest priority) or ``none`` (placed as usual).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.router.ledger import DecodeEntry, Ledger
from pdserve.router.policy import BEST_EFFORT_PRIORITY, Decision, Outcome, RouteRequest
from pdserve.router.predictor import Phase, StepPredictor, inbound
from pdserve.router.prefix import PrefixIndex
from pdserve.router.slo import Admission, SloClass
from pdserve.router.worker_view import DecodeView, PrefillView, mean_prompt
from pdserve.worker.messages import KvEvents, PlacedWork, WorkerLoad, WorkerRole

ErrorSink = Callable[[str, float], None]  # (kind "ttft" | "tpot", observed / predicted)
_NOTHING = PlacedWork()


@dataclass(frozen=True)
class GoodputConfig:
    block_size: int
    local_prefill: bool = True  # conditional disaggregation: may a decode worker prefill itself
    prefill_candidates: int = 4  # best prefill workers (by TTFT) paired with every decode worker
    local_window_s: float = 2.0  # horizon over which a decode worker's prefill share is counted
    local_step_tokens: int = 0  # decode workers' step budget: local prefills run in chunks of it
    prefill_step_tokens: int = 0  # prefill workers' step budget: queued prompts share such steps
    max_prefill_share: float = 0.9  # beyond this a decode worker is taken as saturated
    min_retry_s: float = 0.1
    max_retry_s: float = 30.0


@dataclass(frozen=True)
class _Option:
    prefill: str | None
    decode: str
    ttft: float
    tpot: float
    step: float  # d's predicted step with the request in the batch
    prefill_s: float  # the prefill's own compute
    cached: int
    new_ok: bool
    flips: int
    risk: tuple[float, float]  # (largest, sum of) predicted / target over the targets it touches
    cost: float
    extra: float = 0.0  # local prefill: seconds it adds to d's steps

    @property
    def gain(self) -> int:
        return int(self.new_ok) - self.flips

    def key(self) -> tuple[int, float, float, int, float]:
        return (self.gain, -self.risk[0], -self.risk[1], self.cached, -self.cost)


@dataclass
class _Placed:
    """A placed request's predictions, and the prefill correction factor its TTFT carried: the
    prefill factor learns from observed / *uncorrected* predicted (against the corrected
    prediction a factor settles at the square root of the true ratio; decode keeps that damped
    rule on purpose, see ``on_end``)."""

    prefill_key: str  # the worker that prefills (p, or d itself)
    decode: str
    ttft: float
    step: float
    prefill_factor: float


class GoodputPolicy:
    name = "goodput"

    def __init__(
        self, model: StepPredictor, config: GoodputConfig, on_error: ErrorSink | None = None
    ) -> None:
        self.model = model
        self.config = config
        self.ledger = Ledger()
        self.prefix = PrefixIndex(config.block_size)
        self.on_error = on_error
        self._placed: dict[str, _Placed] = {}
        self._transfers: dict[str, tuple[int, float, int]] = {}  # decode worker -> last counters
        self._foreign: dict[str, PlacedWork] = {}  # decode worker -> the others' work last seen there

    # -- deciding ------------------------------------------------------------------------------
    def decide(
        self, request: RouteRequest, prefill: Sequence[WorkerLoad], decode: Sequence[WorkerLoad], now: float
    ) -> Decision:
        slo = request.slo or SloClass("default")
        ttft_slo = slo.ttft_ms / 1000 if slo.ttft_ms else math.inf
        tpot_slo = slo.tpot_ms / 1000 if slo.tpot_ms else math.inf
        n = request.prompt_tokens
        for w in (*prefill, *decode):
            self.prefix.set_capacity(w.worker_id, w.kv_total)
        remote = self._prefill_candidates(request, prefill, now)
        pick = _best_prefill(remote, ttft_slo)
        best: _Option | None = None
        best_view: DecodeView | None = None
        for d in decode:
            batch = self._decode_view(d, now)
            # What a remote prefill does to d does not depend on the prefill worker: once per d.
            steps = self._tpot_on(d.worker_id, batch, request, now, 0.0)
            room = self._room_wait(d, batch, steps[1])
            opts = (
                []
                if pick is None
                else [self._remote(request, d, batch, steps, room, *pick, ttft_slo, tpot_slo)]
            )
            if not prefill or (
                self.config.local_prefill and (tpot_slo < math.inf or batch.tightest_slo() < math.inf)
            ):
                opts.append(self._local(request, d, batch, now, ttft_slo, tpot_slo))
            for o in opts:
                if best is None or o.key() > best.key():
                    best, best_view = o, batch
        if best is None or best_view is None:
            raise ValueError("goodput policy: no decode worker to route to")
        fits = best.new_ok and best.gain > 0
        priority = request.priority
        if not fits and not slo.empty:
            if slo.admission is Admission.REJECT:
                return Decision(best.decode, best.prefill, Outcome.REJECTED, _miss_reason(best, ttft_slo),
                                best.ttft, best.tpot, self._retry_after(best, best_view, ttft_slo, tpot_slo),
                                priority)  # fmt: skip
            if slo.admission is Admission.BEST_EFFORT:
                priority = BEST_EFFORT_PRIORITY
        outcome = Outcome.BEST_EFFORT if priority == BEST_EFFORT_PRIORITY else (
            Outcome.REMOTE_PREFILL if best.prefill is not None else Outcome.LOCAL_PREFILL)  # fmt: skip
        reason = self._reason(best, remote, bool(prefill), fits, n)
        self._place(request, best, tpot_slo if outcome is not Outcome.BEST_EFFORT else math.inf, now)
        return Decision(best.decode, best.prefill, outcome, reason, best.ttft, best.tpot, 0.0, priority)

    def _prefill_candidates(
        self, request: RouteRequest, prefill: Sequence[WorkerLoad], now: float
    ) -> list[tuple[str, float, float, int]]:
        """(worker, predicted TTFT, prefill compute, cached tokens) of the most promising prefill
        workers: the fastest few, plus the one holding the longest prefix."""
        n = request.prompt_tokens
        budget = self.config.prefill_step_tokens
        rows = []
        for p in prefill:
            pid = p.worker_id
            cached = self._cached(pid, request, now)
            comp = self.model.prefill_s(pid, n - cached, cached)
            q = self._prefill_view(p)
            ttft = q.wait_s(now) + comp
            if budget and q.tokens:
                # A queued prompt finishes with the step that holds its last token, and a step
                # with prompts queued is a full budget's worth: it waits for the steps the
                # tokens ahead fill, then a whole step (not just its own share of one).
                steps = math.ceil((q.tokens + n - cached) / budget)
                full = self.model.prefill_s(pid, min(budget, q.tokens + n - cached))
                ttft = max(ttft, steps * full - q.elapsed_s(now))
            rows.append((pid, ttft, comp, cached))
        rows.sort(key=lambda r: (r[1], -r[3], r[0]))
        top = rows[: self.config.prefill_candidates]
        holder = max(rows, key=lambda r: r[3], default=None)
        if holder is not None and holder[3] > 0 and holder not in top:
            top.append(holder)
        return top

    def _prefill_view(self, p: WorkerLoad) -> PrefillView:
        """``p``'s queue: this router's prefills there and the other replicas' (``p.others``)."""
        o = p.others
        foreign = o.prefills * self.model.prefill_s(p.worker_id, mean_prompt(o)) if o.prefills else 0.0
        return PrefillView(self.ledger.prefill_queue(p.worker_id), o, foreign)

    def _decode_view(self, d: WorkerLoad, now: float) -> DecodeView:
        """``d``'s batch: this router's requests there and the other replicas' (``d.others``).
        Foreign local prefills are priced as ``_local`` prices a prompt on ``d``: queued, they
        delay a local prefill placed now; and each stretches d's steps for the window from when
        this router first sees it (as its own count from when placed): their arrivals are the
        rises of the foreign prompt tokens (one missed where another left between two looks)."""
        o, did = d.others, d.worker_id
        batch = self.ledger.batch(did)
        view = DecodeView(batch, o)
        last = self._foreign.get(did, _NOTHING)
        if o.prefill_tokens != last.prefill_tokens or o.prefills != last.prefills:
            if o.prefill_tokens > last.prefill_tokens:
                count = max(1, o.prefills - last.prefills)
                new = -(-(o.prefill_tokens - last.prefill_tokens) // count)
                batch.add_local_prefill(now, count * self._local_prefill(did, view, new, 0)[1])
            self._foreign[did] = o
        if o.prefills:
            view.foreign_prefill_s = o.prefills * self._local_prefill(did, view, max(1, mean_prompt(o)), 0)[0]
        return view

    def _remote(
        self, request: RouteRequest, d: WorkerLoad, batch: DecodeView, steps: tuple[float, float, float],
        room: float, p: str, ttft: float, comp: float, cached: int, ttft_slo: float, tpot_slo: float,
    ) -> _Option:  # fmt: skip
        n, m = request.prompt_tokens, request.max_tokens
        step, eff_now, eff = steps
        handoff = self.model.transfer_s(d.worker_id, n)
        tpot = eff + (handoff + room) / (m - 1) if m > 1 else 0.0
        new_ok = ttft <= ttft_slo and tpot <= tpot_slo and self._kv_room(d, request)
        flips = batch.misses_between(eff_now, eff)
        risk = _risk((ttft, ttft_slo), (tpot, tpot_slo), (eff, batch.tightest_slo(tpot_slo)))
        cost = ttft + handoff + self._decode_cost(batch, request, eff_now, eff)
        return _Option(p, d.worker_id, ttft, tpot, step, comp, cached, new_ok, flips, risk, cost)

    def _local(
        self, request: RouteRequest, d: WorkerLoad, batch: DecodeView, now: float, ttft_slo: float,
        tpot_slo: float,
    ) -> _Option:  # fmt: skip
        did, m = d.worker_id, request.max_tokens
        cached = self._cached(did, request, now)
        with_chunk, extra = self._local_prefill(did, batch, request.prompt_tokens, cached)
        step, eff_now, eff = self._tpot_on(did, batch, request, now, extra)
        wait = self.ledger.prefill_queue(did).wait_s(now) + batch.foreign_prefill_s
        ttft = wait + self._room_wait(d, batch, eff_now) + with_chunk
        tpot = eff if m > 1 else 0.0
        new_ok = ttft <= ttft_slo and tpot <= tpot_slo and self._kv_room(d, request)
        flips = batch.misses_between(eff_now, eff)
        risk = _risk((ttft, ttft_slo), (tpot, tpot_slo), (eff, batch.tightest_slo(tpot_slo)))
        cost = ttft + extra * (batch.size + 1) + self._decode_cost(batch, request, eff_now, eff)
        return _Option(None, did, ttft, tpot, step, with_chunk, cached, new_ok, flips, risk, cost, extra)

    def _local_prefill(self, did: str, batch: DecodeView, n: int, cached: int) -> tuple[float, float]:
        """A prompt of ``n`` tokens (``cached`` of them cached) prefilled on ``did``: its time in
        d's steps, and what it adds to them."""
        # The prefill rides in d's steps beside its decodes (at least one: the next request to
        # share d); what it adds to those steps is time no decode token comes out.
        sharers = max(1, batch.size)
        avg_ctx = batch.context // batch.size if batch.size else n
        decode_context = sharers * max(1, avg_ctx)  # each at the batch's mean context
        # The prompt goes in ``k`` chunks of what the step budget leaves beside the decodes; each
        # is charged as a chunk at the prompt's middle (its attention grows along the prompt).
        new = n - cached
        room = self.config.local_step_tokens - sharers if self.config.local_step_tokens else new
        k = math.ceil(new / max(1, room))
        chunk = math.ceil(new / k)
        one = self.model.mixed_s(did, [(chunk, cached + (new - chunk) // 2)], sharers, decode_context)
        return k * one, k * max(0.0, one - self.model.mixed_s(did, [], sharers, decode_context))

    def _tpot_on(
        self, did: str, batch: DecodeView, request: RouteRequest, now: float, extra: float
    ) -> tuple[float, float, float]:
        """d's decode step with the request in its batch, and d's effective time per token
        before and after placing it (steps stretched by d's share of time spent prefilling)."""
        step_now = self.model.decode_step_s(did, batch.size, batch.context)
        step = self.model.decode_step_s(did, batch.size + 1, batch.context + _mean_context(request))
        cap, window = self.config.max_prefill_share, self.config.local_window_s
        share = batch.prefill_share(now, window)
        eff_now = step_now / (1 - min(cap, share))
        eff = step / (1 - min(cap, share + extra / window))
        return step, eff_now, eff

    @staticmethod
    def _room_wait(d: WorkerLoad, batch: DecodeView, eff_step: float) -> float:
        """How long a request joining d waits for a slot when d already queues requests (no KV
        room or no sequence slot): one slot frees every ``eff_step * remaining / batch`` seconds
        on average, and ``d.waiting`` requests are ahead of it."""
        if d.waiting <= 0 or batch.size == 0:
            return 0.0
        return d.waiting * eff_step * max(1.0, batch.mean_remaining()) / batch.size

    @staticmethod
    def _decode_cost(batch: DecodeView, request: RouteRequest, step_now: float, step: float) -> float:
        """Request-seconds its decoding adds on d: its own steps, and the slower step every
        request already there takes for the rest of its output (this term spreads load)."""
        own = (request.max_tokens - 1) * step
        return own + batch.size * (step - step_now) * batch.mean_remaining()

    def _cached(self, worker: str, request: RouteRequest, now: float) -> int:
        """Prompt tokens ``worker``'s cache is believed to hold (at least one is always computed)."""
        blocks = self.prefix.cached_blocks(worker, request.block_keys, now)
        return min(blocks * self.config.block_size, request.prompt_tokens - 1)

    def _kv_room(self, d: WorkerLoad, request: RouteRequest) -> bool:
        return d.kv_free * self.config.block_size >= request.prompt_tokens + 1

    def _retry_after(self, o: _Option, batch: DecodeView, ttft_slo: float, tpot_slo: float) -> float:
        """When ``o`` is predicted to have room: its prefill queue's overshoot, or half the
        remaining decode time of d's batch (requests leave it)."""
        wait = o.ttft - ttft_slo if o.ttft > ttft_slo else 0.5 * o.step * max(1.0, batch.mean_remaining())
        return min(self.config.max_retry_s, max(self.config.min_retry_s, wait))

    def _reason(
        self, o: _Option, remote: list[tuple[str, float, float, int]], split: bool, fits: bool, n: int
    ) -> str:
        if not split:
            return "colocated"
        if not fits:
            return "least_bad"
        if o.prefill is not None:
            return "prefix" if o.cached else "predicted_better"
        if o.cached and o.cached >= max((r[3] for r in remote), default=0):
            return "cached_prefix"
        best_remote = min(remote, key=lambda r: r[1], default=None)
        if best_remote is not None and self.model.transfer_s(o.decode, n) > best_remote[2]:
            return "slow_link"
        return "short_prompt"

    def _place(self, request: RouteRequest, o: _Option, tpot_slo: float, now: float) -> None:
        rid = request.request_id
        pkey = o.prefill or o.decode
        entry = DecodeEntry(_mean_context(request), max(1, request.max_tokens // 2), tpot_slo)
        prompt = request.prompt_tokens - o.cached
        self.ledger.add(rid, pkey, o.prefill_s, o.decode, entry, now, prompt)
        if o.prefill is None:
            self.ledger.batch(o.decode).add_local_prefill(now, o.extra)
        self.prefix.record(pkey, request.block_keys, now)
        self._placed[rid] = _Placed(pkey, o.decode, o.ttft, o.step, self.model.factor(pkey, Phase.PREFILL))

    # -- feedback ------------------------------------------------------------------------------
    def on_report(self, load: WorkerLoad) -> None:
        """The ledger is exact for what this router placed; a decode worker's transfer counters
        tell how fast KV actually arrives there (the link, not decode's queue)."""
        t = load.transfers
        if t is None or load.role is WorkerRole.PREFILL:
            return
        last = self._transfers.get(load.worker_id)
        self._transfers[load.worker_id] = (t.bytes, t.seconds, t.count)
        if last is None or t.count <= last[2]:
            return
        nbytes, secs, count = t.bytes - last[0], t.seconds - last[1], t.count - last[2]
        tokens = nbytes / max(1, self.model.profile.kv_bytes_per_token) / count
        predicted = self.model.transfer_s(load.worker_id, round(tokens), corrected=False)
        self.model.observe(inbound(load.worker_id), Phase.TRANSFER, secs / count, predicted)

    def on_kv_events(self, worker_id: str, events: KvEvents) -> None:
        self.prefix.apply(worker_id, events)

    def on_first_token(self, request_id: str, now: float, ttft_s: float) -> None:
        placed = self._placed.get(request_id)
        self.ledger.prefill_done(request_id, now)
        if placed is None:
            return
        self.model.observe(placed.prefill_key, Phase.PREFILL, ttft_s, placed.ttft / placed.prefill_factor)
        if self.on_error is not None and placed.ttft > 0:
            self.on_error("ttft", ttft_s / placed.ttft)

    def on_end(self, request_id: str, now: float, median_itl_s: float | None) -> None:
        self.ledger.decode_done(request_id, now)
        placed = self._placed.pop(request_id, None)
        if placed is None or median_itl_s is None or placed.step <= 0:
            return
        # Against the corrected prediction, which damps the update (it settles at the square root
        # of observed / profile): a request's gaps run over the batches after it joined, which in a
        # pool short of decode keep growing, and learning that whole ratio as the worker's speed
        # collapses admission there (a 4x step on 2P+1D, simulated: 0.27 of requests met against
        # 0.71; the batch it ended in as well: 0.55). A slow decode worker is still learned slow.
        self.model.observe(placed.decode, Phase.DECODE, median_itl_s, placed.step)
        if self.on_error is not None:
            self.on_error("tpot", median_itl_s / placed.step)

    def on_worker_lost(self, worker_id: str) -> None:
        self.ledger.drop_worker(worker_id)
        self._foreign.pop(worker_id, None)
        self.prefix.forget(worker_id)
        self.model.forget(worker_id)


def _mean_context(request: RouteRequest) -> int:
    """The request's context over its decode, on average: the prompt and half the output."""
    return request.prompt_tokens + request.max_tokens // 2


def _best_prefill(
    remote: list[tuple[str, float, float, int]], ttft_slo: float
) -> tuple[str, float, float, int] | None:
    """The prefill candidate every decode worker pairs best with. Paired with one d, options
    differ only in the prefill's TTFT and cached tokens (d's parts are the same for all), and
    ``_Option.key`` ranks them by TTFT (it alone moves the gain, both risks and the cost), then
    cached tokens; without a TTFT target, TTFT is in no risk and the gain: cached tokens first,
    then TTFT (the cost). So one candidate is best for every d, and each d is priced with it
    alone (at 64 workers pricing every pair was most of the router's time a request). Ties go
    to the first, as the scan over every pair kept them."""
    if not remote:
        return None
    if math.isfinite(ttft_slo):
        return min(remote, key=lambda r: (r[1], -r[3]))
    return min(remote, key=lambda r: (-r[3], r[1]))


def _risk(*pairs: tuple[float, float]) -> tuple[float, float]:
    """(largest, sum of) predicted / target, over the pairs that have a target."""
    ratios = [pred / target for pred, target in pairs if math.isfinite(target) and target > 0]
    return (max(ratios), sum(ratios)) if ratios else (0.0, 0.0)


def _miss_reason(o: _Option, ttft_slo: float) -> str:
    return "ttft" if o.ttft > ttft_slo else ("tpot" if not o.new_ok else "harm")
