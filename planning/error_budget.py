"""The SLO's error budget as the pool planner spends it (pure).

With ``PlannerConfig.spend`` > 0 the requests that met beyond the attainment target over the
last ``budget_intervals`` windows are a bank, and growing and holding size the next interval
for a lower attainment (down to the target less the SLO's own allowance) whose extra misses
spend up to ``spend`` of it: a quiet stretch pays for a trough held on fewer workers, and a
step's misses empty the bank, so the next growth sizes for the target again. The way down
never spends it (its margin is what keeps the pools from cycling).
"""

from __future__ import annotations

import math
from collections import deque

from pdserve.planning.planner_data import Observation, PlannerConfig


class ErrorBudget:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        # (ended, met) of the last decisions' windows: the bank
        self.ledger: deque[tuple[int, float]] = deque(maxlen=config.budget_intervals)

    def quantile(self, obs: Observation) -> float:
        """Bank the decision window ``obs`` and return the quantile growing and holding size
        the next interval for: the SLO's, less what spending ``spend`` of the banked surplus
        (met requests beyond the quantile over the last ``budget_intervals`` windows) on its
        expected requests allows, at most the SLO's own allowance (``1 - quantile``) below it."""
        c = self.config
        # every request the SLO counted, whatever layout it arrived under; a window where
        # nothing ended banks nothing but still ages the bank
        n, attainment = obs.served
        ended = n if math.isfinite(attainment) else 0
        self.ledger.append((ended, ended * attainment if ended else 0.0))
        if not c.spend:
            return c.quantile
        # the windows still inside the horizon when the next one ends (the oldest leaves it)
        kept = list(self.ledger)[-(c.budget_intervals - 1) :]
        bank = sum(met - c.quantile * n for n, met in kept)
        # the next interval may carry as many requests as the busiest recent one (a quiet window
        # must not let a small bank lower the target for a busy one)
        expected = max(c.min_requests, *(n for n, _ in kept))
        return c.quantile - min(1 - c.quantile, max(0.0, c.spend * bank / expected))
