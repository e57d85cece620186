"""Ending a simulated point as soon as it can no longer meet its attainment target (pure).

A goodput search only asks of each rate whether joint SLO attainment reaches the target (90 %).
An overloaded layout answers "no" long before its last request ends — and overloaded points are
the slowest to simulate, their queues growing to the end. ``EarlyStop`` counts requests that have
certainly missed (a first token later than the TTFT target; at the end, a TPOT or end-to-end
latency over target, judged exactly as ``Slo.met`` judges the finished request; a failure) and
says to stop once even every other request meeting the SLO would leave attainment below the
target: the point's pass/fail answer, hence every goodput found, is the one the full run gives.
"""

from __future__ import annotations

from pdserve.bench.metrics import RequestResult, Slo


class EarlyStop:
    def __init__(self, slo: Slo, total: int, target: float, already_missed: int = 0) -> None:
        if total <= 0:
            raise ValueError("total must be positive")
        self.slo = slo
        self.total = total
        self.target = target
        self.misses = already_missed
        self._missed: set[str] = set()
        self.stopped = False

    @property
    def attainment_bound(self) -> float:
        """The highest attainment the point can still reach (``good / total`` as ``summarize``
        computes it, with every request not yet missed counted good)."""
        return (self.total - self.misses) / self.total

    def _miss(self, key: str) -> bool:
        if key not in self._missed:
            self._missed.add(key)
            self.misses += 1
            if self.attainment_bound < self.target:
                self.stopped = True
        return self.stopped

    def first_token(self, key: str, ttft_s: float) -> bool:
        """A request's first token left ``ttft_s`` after it arrived; True: stop the run."""
        if self.slo.ttft_ms and ttft_s * 1000 > self.slo.ttft_ms:
            return self._miss(key)
        return self.stopped

    def finished(self, key: str, result: RequestResult) -> bool:
        if not self.slo.met(result):
            return self._miss(key)
        return self.stopped

    def failed(self, key: str) -> bool:
        return self._miss(key)
