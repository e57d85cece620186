"""The ``goodput`` dispatcher: route each request where it is predicted to meet its SLO without
costing others theirs; refuse it early when nowhere can (pure Python).

For every option — each decode worker ``d`` paired with a prefill worker ``p``, or ``d`` alone
prefilling locally (conditional disaggregation) — it predicts, from ``LatencyModel`` and its own
``Ledger`` of placed work:

- TTFT: the prefill queue ahead of the request on ``p`` (or on ``d``) plus its own prefill,
  less what ``p``'s cache is believed to hold (``PrefixIndex``). In this design the first
  token leaves the prefill worker, so the KV transfer is not on the TTFT path;
- TPOT: ``d``'s decode step with the request in its batch, plus the KV hand-off over the
  ``p -> d`` link spread over the request's tokens (the hand-off is its first token gap);
- harm: the requests already on ``d`` whose TPOT target the bigger batch (and, for a local
  prefill, the prefill's stall spread over their remaining tokens) would push out of reach.

Options are ranked by (requests newly meeting their SLO minus requests it makes miss, cached
prefix tokens, -cost). The cost is the latency the option adds across requests, in
request-seconds: the request's own TTFT, hand-off and decode steps, the slower step every
request already on ``d`` takes for the rest of its output (so load spreads), and for a local
prefill the time the prefill adds to ``d``'s steps, charged to every request sharing ``d`` (its
batch and the next one to arrive). A short prompt rides in a memory-bound decode step almost for free,
so it stays local; a long one would stall the batch, so it goes to a prefill worker — unless
the link is slow enough or the decode worker's cache holds enough of it to change the sum.

Admission: when the best option does not meet the request's SLO (or meets it only by making
others miss theirs), its class decides: ``reject`` (a REJECTED decision with a retry hint),
``best-effort`` (placed at the lowest priority) or ``none`` (placed as usual).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from model_runtime.worker.messages import WorkerLoad
from router.latency_model import LatencyModel, Phase, link_key
from router.ledger import DecodeBatch, DecodeEntry, Ledger
from router.policy import BEST_EFFORT_PRIORITY, Decision, Outcome, RouteRequest
from router.prefix import PrefixIndex
from router.slo import Admission, SloClass

ErrorSink = Callable[[str, float], None]  # (kind "ttft" | "tpot", observed / predicted)


@dataclass(frozen=True)
class GoodputConfig:
    block_size: int
    local_prefill: bool = True  # conditional disaggregation: may a decode worker prefill itself
    prefill_candidates: int = 4  # best prefill workers (by TTFT) paired with every decode worker
    min_retry_s: float = 0.1
    max_retry_s: float = 30.0


@dataclass(frozen=True)
class _Option:
    prefill: str | None
    decode: str
    ttft: float
    tpot: float
    step: float  # d's predicted step with the request in the batch
    handoff: float  # predicted KV transfer (0 for a local prefill)
    prefill_s: float  # the prefill's own compute
    cached: int
    new_ok: bool
    flips: int
    cost: float

    @property
    def gain(self) -> int:
        return int(self.new_ok) - self.flips

    def key(self) -> tuple[int, int, float]:
        return (self.gain, self.cached, -self.cost)


@dataclass
class _Placed:
    prefill_key: str  # the worker that prefills (p, or d itself)
    decode: str
    link: str | None
    ttft: float
    step: float
    handoff: float


class GoodputPolicy:
    name = "goodput"

    def __init__(self, model: LatencyModel, config: GoodputConfig, on_error: ErrorSink | None = None) -> None:
        self.model = model
        self.config = config
        self.ledger = Ledger()
        self.prefix = PrefixIndex(config.block_size)
        self.on_error = on_error
        self._placed: dict[str, _Placed] = {}

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
        best: _Option | None = None
        for d in decode:
            batch = self.ledger.batch(d.worker_id)
            opts = [self._remote(request, d, batch, p, ttft, comp, cached, ttft_slo, tpot_slo)
                    for p, ttft, comp, cached in remote]  # fmt: skip
            if self.config.local_prefill or not prefill:
                opts.append(self._local(request, d, batch, now, ttft_slo, tpot_slo))
            for o in opts:
                if best is None or o.key() > best.key():
                    best = o
        if best is None:
            raise ValueError("goodput policy: no decode worker to route to")
        fits = best.new_ok and best.gain > 0
        priority = request.priority
        if not fits and not slo.empty:
            if slo.admission is Admission.REJECT:
                return Decision(best.decode, best.prefill, Outcome.REJECTED, _miss_reason(best, ttft_slo),
                                best.ttft, best.tpot, self._retry_after(best, ttft_slo, tpot_slo),
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
        rows = []
        for p in prefill:
            pid = p.worker_id
            cached = min(self.prefix.cached_blocks(pid, request.block_keys) * self.config.block_size, n - 1)
            comp = self.model.prefill_s(pid, n - cached, cached)
            rows.append((pid, self.ledger.prefill_queue(pid).wait_s(now) + comp, comp, cached))
        rows.sort(key=lambda r: (r[1], -r[3], r[0]))
        top = rows[: self.config.prefill_candidates]
        holder = max(rows, key=lambda r: r[3], default=None)
        if holder is not None and holder[3] > 0 and holder not in top:
            top.append(holder)
        return top

    def _remote(
        self, request: RouteRequest, d: WorkerLoad, batch: DecodeBatch, p: str, ttft: float, comp: float,
        cached: int, ttft_slo: float, tpot_slo: float,
    ) -> _Option:  # fmt: skip
        n, m = request.prompt_tokens, request.max_tokens
        step_now, step = self._steps(d.worker_id, batch, request)
        handoff = self.model.transfer_s(p, d.worker_id, n)
        tpot = step + handoff / (m - 1) if m > 1 else 0.0
        new_ok = ttft <= ttft_slo and tpot <= tpot_slo and self._kv_room(d, request)
        flips = batch.misses_between(step_now, step)
        cost = ttft + handoff + self._decode_cost(batch, request, step_now, step)
        return _Option(p, d.worker_id, ttft, tpot, step, handoff, comp, cached, new_ok, flips, cost)

    def _local(
        self, request: RouteRequest, d: WorkerLoad, batch: DecodeBatch, now: float, ttft_slo: float,
        tpot_slo: float,
    ) -> _Option:  # fmt: skip
        did, n, m = d.worker_id, request.prompt_tokens, request.max_tokens
        cached = min(self.prefix.cached_blocks(did, request.block_keys) * self.config.block_size, n - 1)
        step_now, step = self._steps(did, batch, request)
        # The prefill rides in d's steps beside its decodes (at least one: the next request to
        # share d); what it adds to those steps is what every sharer waits.
        sharers = max(1, batch.size)
        decodes = [(1, max(1, batch.context // max(1, batch.size) or request.prompt_tokens))] * sharers
        chunk = (n - cached, cached)
        with_chunk = self.model.step_s(did, [chunk, *decodes], Phase.PREFILL)
        extra = max(0.0, with_chunk - self.model.step_s(did, decodes, Phase.PREFILL))
        ttft = self.ledger.prefill_queue(did).wait_s(now) + with_chunk
        tpot = step if m > 1 else 0.0
        new_ok = ttft <= ttft_slo and tpot <= tpot_slo and self._kv_room(d, request)
        stall = extra / max(1.0, batch.mean_remaining())
        flips = batch.misses_between(step_now, step + stall)
        cost = ttft + extra * (batch.size + 1) + self._decode_cost(batch, request, step_now, step)
        return _Option(None, did, ttft, tpot, step, 0.0, with_chunk, cached, new_ok, flips, cost)

    def _steps(self, did: str, batch: DecodeBatch, request: RouteRequest) -> tuple[float, float]:
        """d's decode step now, and with this request added to its batch."""
        ctx = request.prompt_tokens + request.max_tokens // 2
        now = self.model.decode_step_s(did, batch.size, batch.context)
        return now, self.model.decode_step_s(did, batch.size + 1, batch.context + ctx)

    @staticmethod
    def _decode_cost(batch: DecodeBatch, request: RouteRequest, step_now: float, step: float) -> float:
        """Request-seconds its decoding adds on d: its own steps, and the slower step every
        request already there takes for the rest of its output (this term spreads load)."""
        own = (request.max_tokens - 1) * step
        return own + batch.size * (step - step_now) * batch.mean_remaining()

    def _kv_room(self, d: WorkerLoad, request: RouteRequest) -> bool:
        return d.kv_free * self.config.block_size >= request.prompt_tokens + 1

    def _retry_after(self, o: _Option, ttft_slo: float, tpot_slo: float) -> float:
        """When ``o`` is predicted to have room: its prefill queue's overshoot, or half the
        remaining decode time of d's batch (requests leave it)."""
        if o.ttft > ttft_slo:
            wait = o.ttft - ttft_slo
        else:
            batch = self.ledger.batch(o.decode)
            wait = 0.5 * o.step * max(1.0, batch.mean_remaining())
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
        if best_remote is not None and self.model.transfer_s(best_remote[0], o.decode, n) > best_remote[2]:
            return "slow_link"
        return "short_prompt"

    def _place(self, request: RouteRequest, o: _Option, tpot_slo: float, now: float) -> None:
        rid = request.request_id
        pkey = o.prefill or o.decode
        ctx = request.prompt_tokens + request.max_tokens // 2
        entry = DecodeEntry(ctx, max(1, request.max_tokens // 2), tpot_slo)
        self.ledger.add(rid, pkey, o.prefill_s, o.decode, entry, now)
        self.prefix.record(pkey, request.block_keys)
        link = link_key(o.prefill, o.decode) if o.prefill is not None else None
        self._placed[rid] = _Placed(pkey, o.decode, link, o.ttft, o.step, o.handoff)

    # -- feedback ------------------------------------------------------------------------------
    def on_report(self, worker_id: str) -> None:
        pass  # the ledger is exact for what this router placed; reports add nothing to it

    def on_first_token(self, request_id: str, now: float, ttft_s: float) -> None:
        placed = self._placed.get(request_id)
        self.ledger.prefill_done(request_id, now)
        if placed is None:
            return
        self.model.observe(placed.prefill_key, Phase.PREFILL, ttft_s, placed.ttft)
        if self.on_error is not None and placed.ttft > 0:
            self.on_error("ttft", ttft_s / placed.ttft)

    def on_handoff(self, request_id: str, gap_s: float) -> None:
        placed = self._placed.get(request_id)
        if placed is None or placed.link is None or placed.handoff <= 0:
            return
        self.model.observe(placed.link, Phase.TRANSFER, gap_s - placed.step, placed.handoff)

    def on_end(self, request_id: str, now: float, median_itl_s: float | None) -> None:
        self.ledger.decode_done(request_id, now)
        placed = self._placed.pop(request_id, None)
        if placed is None or median_itl_s is None or placed.step <= 0:
            return
        self.model.observe(placed.decode, Phase.DECODE, median_itl_s, placed.step)
        if self.on_error is not None:
            self.on_error("tpot", median_itl_s / placed.step)

    def on_worker_lost(self, worker_id: str) -> None:
        self.ledger.drop_worker(worker_id)
        self.prefix.forget(worker_id)
        self.model.forget(worker_id)


def _miss_reason(o: _Option, ttft_slo: float) -> str:
    return "ttft" if o.ttft > ttft_slo else ("tpot" if not o.new_ok else "harm")
