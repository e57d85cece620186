"""Ending a simulated point as soon as it can no longer meet its attainment target (pure).

A goodput search only asks of each rate whether joint SLO attainment reaches the target (90 %).
An overloaded layout answers "no" long before its last request ends — and overloaded points are
the slowest to simulate, their queues growing to the end. ``EarlyStop`` counts requests that have
certainly missed (a first token later than the TTFT target; at the end, a TPOT or end-to-end
latency over target, judged exactly as ``Slo.met`` judges the finished request; a failure) and
says to stop once even every other request meeting the SLO would leave attainment below the
target. The other way round, it counts requests that finished within the SLO and says to stop
once they alone reach the target, whatever the rest do. Either way the point's pass/fail
answer, hence every goodput found, is the one the full run gives.
"""

from __future__ import annotations

from pdserve.bench.metrics import RequestResult, Slo


class EarlyStop:
    def __init__(
        self, slo: Slo, total: int, target: float, already_missed: int = 0, on_pass: bool = True
    ) -> None:
        if total <= 0:
            raise ValueError("total must be positive")
        self.slo = slo
        self.total = total
        self.target = target
        self.on_pass = on_pass  # False: only a miss ends the run (a pass runs to its end)
        self.misses = already_missed
        self.good = 0
        self._missed: set[str] = set()
        self.stopped = False
        self.passed = False  # stopped because the target is reached whatever the rest do

    @property
    def attainment_bound(self) -> float:
        """What the point is known to reach, on the side of the target it ended on: when it
        failed, the most it could still reach (every request not yet missed counted good); when
        it passed, the least (only the good ones so far); while running, the former. Computed
        as ``summarize`` computes attainment."""
        if self.passed:
            return self.good / self.total
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
        if key not in self._missed:  # a late first token already counted it out
            self.good += 1
            if self.on_pass and self.good / self.total >= self.target:
                self.stopped = self.passed = True
        return self.stopped

    def failed(self, key: str) -> bool:
        return self._miss(key)

    def missed(self, key: str) -> bool:
        """A request certainly misses, before its last token (its TTFT, TPOT or latency is
        already past target whatever comes next); True: stop the run."""
        return self._miss(key)
