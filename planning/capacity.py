"""What a disaggregated layout would deliver for a measured workload (pure, microseconds).

The planner asks this for every candidate (P prefill, D decode workers) each interval, so it
is closed-form queueing on the step-time model (``pdserve.steptime``), not a simulation:

- **prefill**: each request needs ``s = prefill_time(new prompt tokens)`` of a prefill worker,
  ``new = prompt · (1 − prefix hit share)``; arrivals at ``λ`` offer ``a = λ s`` worker-seconds
  a second to P workers (utilization ``ρ = a / P``). The router sends each prompt to the worker
  whose queue is done first, which is one first-come queue served by the whole pool: M/D/P,
  not P queues of M/D/1 (at 30 workers and ρ = 0.85 the difference is 35 ms of TTFT against
  240). The M/M/P waiting-time tail is ``P(W > t) = C(P, a) e^{−(P − a) t / s}`` (``C``: Erlang
  C, the chance of waiting at all), halved in time for deterministic service
  (Pollaczek–Khinchine): the wait at quantile ``q`` is ``max(0, ln(C / (1 − q))) · s / (2(P − a))``
  (for one worker ``C = ρ``: the M/D/1 formula). TTFT at ``q`` is that wait plus the prefill
  and KV hand-off of the prompt at ``q`` (``Workload.prompt_tail_tokens``; the mean when not
  measured): prompt lengths are skewed, and at light load a TTFT quantile is the long prompts'
  own prefill (the sum of the two quantiles stands in for the quantile of the sum: close under
  these distributions, not a bound);
- **decode**: by Little's law each decode worker holds ``B = (λ / D) · output · TPOT(B)``
  requests, and ``TPOT(B)`` is the step time of a batch of ``B`` at the mean context
  (``prompt + output / 2``); the fixed point is found by bisection, and there is none when the
  batch would outgrow the worker (``a · TPOT(B) > B`` for every ``B`` up to what its KV pool
  holds, or up to ``max_seqs``, the engine's ``max_num_seqs``, when that is fewer: the requests
  past it wait for a slot, and their gaps grow without bound). ``decode_load``, when given, is
  what decode is priced for instead of ``load``: the arrivals over a longer window
  (``LoadMemory.decode_span``), since a decode pool rides out a short burst in its batch and queue.

``admitted`` < 1 prices the layout as the router's admission would run it under overload:
it refuses what is predicted to miss, the longest prompts first, so the prefill pool carries
the lightest ``admitted`` share of the arrivals (``Workload.light``) and attainment needs
``quantile / admitted`` of those within the targets (the TTFT quantile asked of them; the
prompt at that quantile of the kept ones is the whole load's ``quantile`` prompt). A heavy tail
makes this matter: the longest tenth of a conversation trace's prompts carries a third of its
prefill. Decode is priced for every arrival (its refusals are not the long prompts').

``factors`` scale the model's prefill and decode times by what the router measured (its
corrected predictor's factors), so a profile that is off for this hardware is corrected before
the planner trusts it; ``decode_fixed_s`` adds a cost to every decode step on top (the part of a
step that does not grow with the batch: launches, scheduling, sampling, streaming).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdserve.router.workload_window import Workload
from pdserve.steptime.model import StepTimeModel


@dataclass(frozen=True)
class Prediction:
    ttft_s: float  # at the quantile asked for; inf when prefill is overloaded
    tpot_s: float  # mean; inf when decode cannot keep up
    prefill_util: float
    decode_batch: float  # requests a decode worker holds
    admitted: float = 1.0  # the share of the arrivals served (the rest refused on arrival)

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.ttft_s) and math.isfinite(self.tpot_s)


def predict(
    model: StepTimeModel,
    load: Workload,
    prefill: int,
    decode: int,
    quantile: float = 0.9,
    factors: tuple[float, float] = (1.0, 1.0),
    admitted: float = 1.0,
    max_seqs: int | None = None,
    decode_load: Workload | None = None,
    decode_fixed_s: float = 0.0,
) -> Prediction:
    if prefill < 1 or decode < 1:
        raise ValueError("a disaggregated layout needs at least one worker of each role")
    if not 0 < quantile < admitted <= 1:
        raise ValueError(f"need 0 < quantile < admitted <= 1, got {quantile} and {admitted}")
    if max_seqs is not None and max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    whole = load
    if admitted < 1 and load.rate > 0:
        kept = load.light_prompt_tokens(admitted)
        load = replace(load, rate=load.rate * admitted, prompt_tokens=kept, light=())
        quantile /= admitted
    pf, df = factors
    if load.rate == 0 and (decode_load is None or decode_load.rate == 0):  # nothing arrives: idle workers
        s = model.prefill_time(max(1, round(load.prompt_tokens or 1))) * pf
        return Prediction(s, _step(model, 1, _context(load)) * df + decode_fixed_s, 0.0, 0.0)
    new = max(1, round(load.prompt_tokens * (1 - load.cached_share)))
    s = model.prefill_time(new) * pf
    offered = load.rate * s
    rho = offered / prefill
    if rho >= 1:
        ttft = math.inf
    else:
        wait_p = erlang_c(prefill, offered)
        wait = (
            max(0.0, math.log(wait_p / (1 - quantile))) * s / (2 * (prefill - offered)) if wait_p > 0 else 0.0
        )
        tail = load.prompt_tail_tokens or load.prompt_tokens
        own = model.prefill_time(max(1, round(tail * (1 - load.cached_share)))) * pf
        ttft = own + wait + model.transfer_time(round(tail))
    dl = whole if decode_load is None else decode_load
    tpot, batch = _decode(model, dl, decode, df, max_seqs, decode_fixed_s)
    return Prediction(ttft, tpot, rho, batch, admitted)


def erlang_c(servers: int, offered: float) -> float:
    """The chance that an arrival waits in an M/M/``servers`` queue offered ``offered``
    Erlangs (< ``servers``), by the Erlang B recursion (stable for any pool size)."""
    if offered <= 0:
        return 0.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1 - b))


def _context(load: Workload) -> float:
    """The mean context a decode step attends over: the prompt and half the output."""
    return load.prompt_tokens + load.output_tokens / 2


def _emitted(load: Workload, decode: int) -> float:
    """Tokens a second each of ``decode`` workers must emit."""
    return load.rate / decode * max(1.0, load.output_tokens)


def _batch_cap(model: StepTimeModel, load: Workload, max_seqs: int | None) -> float:
    """The most requests a decode worker holds: what its KV pool fits, or its slots."""
    cap = max(1.0, model.kv_capacity_tokens / max(1.0, load.prompt_tokens + load.output_tokens))
    return cap if max_seqs is None else min(cap, float(max_seqs))


def _step(model: StepTimeModel, batch: float, ctx: float) -> float:
    n = max(1, math.ceil(batch))
    return model.decode_time(n, max(n, round(n * ctx)))


def decode_step_at(
    model: StepTimeModel, load: Workload, decode: int, tpot_s: float, max_seqs: int | None = None
) -> float | None:
    """The model's decode step time (uncorrected) at the batch Little's law puts on each of
    ``decode`` workers that served ``load`` at a measured TPOT of ``tpot_s``: what the measured
    step time is to be compared with. None when that batch is past what a worker holds (its
    requests then wait for a slot, and their TPOT measures the wait, not the step)."""
    if decode < 1 or not (math.isfinite(tpot_s) and tpot_s > 0) or load.rate <= 0:
        return None
    batch = _emitted(load, decode) * tpot_s
    if batch > _batch_cap(model, load, max_seqs):
        return None
    return _step(model, batch, _context(load))


def _decode(
    model: StepTimeModel,
    load: Workload,
    decode: int,
    factor: float,
    max_seqs: int | None,
    fixed_s: float,
) -> tuple[float, float]:
    """(TPOT, batch) at the fixed point of Little's law on one decode worker."""
    ctx = _context(load)
    a = _emitted(load, decode)

    def tpot(b: float) -> float:
        return _step(model, b, ctx) * factor + fixed_s

    if a == 0:
        return tpot(1), 0.0
    cap = _batch_cap(model, load, max_seqs)
    if a * tpot(cap) > cap:  # even the largest batch (a full pool's, or the step's cap) emits too slowly
        return math.inf, cap
    lo, hi = 0.0, cap  # f(b) = a·tpot(b) − b: > 0 at 0, <= 0 at cap
    for _ in range(60):
        mid = (lo + hi) / 2
        if a * tpot(mid) > mid:
            lo = mid
        else:
            hi = mid
    return tpot(hi), hi
