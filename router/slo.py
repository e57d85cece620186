"""SLO classes and the router's live attainment/goodput window (pure Python).

A request is judged once, when it ends, against its SLO class (joint TTFT and TPOT, as
goodput is defined): a failed or rejected request is a miss. ``SloTracker`` keeps the outcomes of the last few
minutes so the router can export attainment and goodput as gauges and draw ``/dashboard``
without a Prometheus server; the cumulative counters go to ``/metrics`` as well.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass


class Admission(enum.Enum):
    """What the router does with a request no worker pair is predicted to serve within its SLO."""

    REJECT = "reject"  # RESOURCE_EXHAUSTED / HTTP 429 with a Retry-After hint, at once
    BEST_EFFORT = "best-effort"  # admitted at low priority; it never displaces admitted work
    NONE = "none"  # admitted as usual (no admission control)


@dataclass(frozen=True)
class SloClass:
    name: str
    ttft_ms: float = 0.0  # 0: no target
    tpot_ms: float = 0.0
    admission: Admission = Admission.NONE

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an SLO class needs a name")
        # NaN fails too: a NaN target was met by no request (every one judged a miss or refused)
        if not (0 <= self.ttft_ms < math.inf and 0 <= self.tpot_ms < math.inf):
            raise ValueError(f"SLO class {self.name!r}: targets must be finite and >= 0 ms (0: none)")

    @property
    def empty(self) -> bool:
        return not (self.ttft_ms or self.tpot_ms)

    def met(self, ttft_ms: float, tpot_ms: float) -> tuple[bool, bool]:
        """(TTFT met, TPOT met); a missing target is always met."""
        return (not self.ttft_ms or ttft_ms <= self.ttft_ms, not self.tpot_ms or tpot_ms <= self.tpot_ms)

    @classmethod
    def parse(cls, spec: str) -> SloClass:
        """``NAME:ttft=MS,tpot=MS[,admission=reject|best-effort|none]``, e.g. ``chat:ttft=250,tpot=100``."""
        name, _, rest = spec.partition(":")
        fields: dict[str, str] = {}
        for part in filter(None, rest.split(",")):
            key, eq, value = part.partition("=")
            if not eq or key not in ("ttft", "tpot", "admission"):
                raise ValueError(f"SLO class {spec!r}: expected NAME:ttft=MS,tpot=MS[,admission=...]")
            fields[key] = value
        try:
            return cls(
                name.strip(),
                float(fields.get("ttft", 0)),
                float(fields.get("tpot", 0)),
                Admission(fields.get("admission", "none")),
            )
        except ValueError as e:
            raise ValueError(f"SLO class {spec!r}: {e}") from None


@dataclass(frozen=True)
class SloHint:
    """A request's own targets (0: its class's), its SLO class ("": the default) and priority."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    priority: int = 0
    slo_class: str = ""


DEFAULT_CLASS = "default"


@dataclass(frozen=True)
class SloBook:
    """The configured classes; a request names one, or brings its own targets (the SLO hint)."""

    classes: Mapping[str, SloClass]
    default: str = DEFAULT_CLASS

    def __post_init__(self) -> None:
        if self.default not in self.classes:
            raise ValueError(f"default SLO class {self.default!r} is not configured")

    @classmethod
    def of(cls, *classes: SloClass, default: str | None = None) -> SloBook:
        book = {c.name: c for c in classes} or {DEFAULT_CLASS: SloClass(DEFAULT_CLASS)}
        return cls(book, default or next(iter(book)))

    def resolve(self, name: str = "", ttft_ms: float = 0.0, tpot_ms: float = 0.0) -> SloClass:
        """The request's class; explicit targets override the class's own (same admission)."""
        if name and name not in self.classes:
            raise ValueError(f"unknown SLO class {name!r}; configured: {', '.join(sorted(self.classes))}")
        base = self.classes[name or self.default]
        if ttft_ms or tpot_ms:
            return SloClass(base.name, ttft_ms or base.ttft_ms, tpot_ms or base.tpot_ms, base.admission)
        return base

    def thresholds_s(self) -> tuple[list[float], list[float]]:
        """TTFT and TPOT thresholds in seconds: histogram bucket bounds, so attainment is exact."""
        ttft = sorted({c.ttft_ms / 1000 for c in self.classes.values() if c.ttft_ms})
        tpot = sorted({c.tpot_ms / 1000 for c in self.classes.values() if c.tpot_ms})
        return ttft, tpot


@dataclass(frozen=True)
class SloResult:
    t: float  # when the request ended (monotonic seconds)
    slo_class: str
    ttft_ms: float
    tpot_ms: float
    ttft_met: bool
    tpot_met: bool
    ok: bool  # finished without error
    arrival: float = math.nan  # when it arrived (monotonic seconds; NaN: when it ended)

    @property
    def good(self) -> bool:
        return self.ok and self.ttft_met and self.tpot_met

    @property
    def arrived(self) -> float:
        return self.t if math.isnan(self.arrival) else self.arrival


@dataclass(frozen=True)
class WindowStats:
    t: float  # end of the window
    requests: int
    good: int
    goodput_rps: float
    attainment: float  # NaN with no requests
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[i]


def _ended(
    outs: list[SloResult], times: list[float], now: float, span_s: float, slo_class: str | None
) -> tuple[list[SloResult], list[float], list[float]]:
    """The outcomes that ended in ``(now - span_s, now]`` (one class or all), with the sorted
    TTFTs and TPOTs (ms) of those that finished."""
    lo, hi = bisect.bisect_right(times, now - span_s), bisect.bisect_right(times, now)
    picked = [o for o in outs[lo:hi] if slo_class is None or o.slo_class == slo_class]
    ok = [o for o in picked if o.ok]
    return picked, sorted(o.ttft_ms for o in ok), sorted(o.tpot_ms for o in ok if o.tpot_ms > 0)


def _stats(
    outs: list[SloResult], times: list[float], now: float, span_s: float, slo_class: str | None
) -> WindowStats:
    picked, ttft, tpot = _ended(outs, times, now, span_s, slo_class)
    good = sum(o.good for o in picked)
    return WindowStats(
        t=now,
        requests=len(picked),
        good=good,
        goodput_rps=good / span_s,
        attainment=good / len(picked) if picked else math.nan,
        ttft_p50_ms=_pct(ttft, 0.5),
        ttft_p99_ms=_pct(ttft, 0.99),
        tpot_p50_ms=_pct(tpot, 0.5),
        tpot_p99_ms=_pct(tpot, 0.99),
    )


class SloTracker:
    """Outcomes of the last ``horizon_s`` seconds, kept in end-time order (bounded)."""

    def __init__(self, horizon_s: float = 600.0, max_outcomes: int = 200_000) -> None:
        self.horizon_s = horizon_s
        self._outcomes: deque[SloResult] = deque(maxlen=max_outcomes)

    def record(self, outcome: SloResult) -> None:
        self._outcomes.append(outcome)
        cutoff = outcome.t - self.horizon_s
        while self._outcomes and self._outcomes[0].t < cutoff:
            self._outcomes.popleft()

    def window(self, now: float, span_s: float = 60.0, slo_class: str | None = None) -> WindowStats:
        """Stats of the requests that ended in ``(now - span_s, now]`` (one class or all)."""
        outs = list(self._outcomes)
        return _stats(outs, [o.t for o in outs], now, span_s, slo_class)

    def series(self, now: float, horizon_s: float = 300.0, step_s: float = 10.0) -> list[WindowStats]:
        """One ``WindowStats`` per ``step_s`` over the last ``horizon_s`` (oldest first), each
        over a trailing window of ``step_s`` — what ``/dashboard`` plots. One copy of the
        outcomes for the whole series, then a binary search per window."""
        outs = list(self._outcomes)
        times = [o.t for o in outs]
        n = max(1, int(horizon_s // step_s))
        return [_stats(outs, times, now - (n - 1 - i) * step_s, step_s, None) for i in range(n)]

    def tails(
        self, now: float, span_s: float, q: float, since: float = -math.inf
    ) -> tuple[int, float, float, float]:
        """``(requests, attainment, TTFT at quantile q, median TPOT)`` over the requests that
        ended in ``(now - span_s, now]`` having arrived at ``since`` or later (seconds; NaN for
        what an empty window cannot say)."""
        outs = [o for o in self._outcomes if o.arrived >= since]
        picked, ttft, tpot = _ended(outs, [o.t for o in outs], now, span_s, None)
        attainment = sum(o.good for o in picked) / len(picked) if picked else math.nan
        return len(picked), attainment, _pct(ttft, q) / 1000, _pct(tpot, 0.5) / 1000

    def classes(self) -> list[str]:
        return sorted({o.slo_class for o in self._outcomes})
