"""The workload the router is seeing, over a trailing window (pure): what the pool planner
sizes the pools for.

Arrivals are counted when a request is offered (refused ones too: they are load the pools did
not carry); output lengths and prefix hits are known only when a request ends, so they come
from the requests that ended in the window (the requested ``max_tokens`` of the arrivals
stands in while none has).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """What the router measured over a window."""

    rate: float  # arrivals per second
    prompt_tokens: float  # mean
    output_tokens: float  # mean
    cached_share: float = 0.0  # of prompt tokens served from prefix caches
    # the prompt length at the quantile the SLO is held to (0: not measured; the mean stands
    # in): a TTFT quantile is that prompt's own prefill plus the queue, and prompt lengths are
    # skewed (a conversation trace's 90th percentile is 2.4x its mean)
    prompt_tail_tokens: float = 0.0
    # ((share, mean prompt of the lightest ``share`` of the arrivals), ...): the load left when
    # the router's admission refuses the rest — under overload it refuses what is predicted to
    # miss, the longest prompts first — for the shares the planner may count on
    light: tuple[tuple[float, float], ...] = ()
    # the window's length (0: not known): a longer window's rate strays less from the next one's
    span_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rate", "prompt_tokens", "output_tokens", "prompt_tail_tokens", "span_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if not 0 <= self.cached_share <= 1:
            raise ValueError(f"cached_share must be in [0, 1], got {self.cached_share}")
        for share, mean in self.light:
            if not (0 < share < 1 and 0 <= mean <= self.prompt_tokens * (1 + 1e-9) and math.isfinite(mean)):
                raise ValueError(
                    f"a light share needs 0 < share < 1 and 0 <= its mean <= the mean, got {share, mean}"
                )

    def light_prompt_tokens(self, share: float) -> float:
        """The mean prompt of the lightest ``share`` of the arrivals (the mean for 1)."""
        if share == 1:
            return self.prompt_tokens
        for s, mean in self.light:
            if s == share:
                return mean
        raise ValueError(f"the workload was not measured at the share {share}")


class WorkloadWindow:
    def __init__(self, horizon_s: float = 600.0, max_entries: int = 200_000) -> None:
        self.horizon_s = horizon_s
        self._arrivals: deque[tuple[float, int, int]] = deque(maxlen=max_entries)  # (t, prompt, max_tokens)
        self._ends: deque[tuple[float, int, int, int]] = deque(
            maxlen=max_entries
        )  # (t, prompt, cached, output)

    def arrived(self, t: float, prompt_tokens: int, max_tokens: int) -> None:
        self._arrivals.append((t, prompt_tokens, max_tokens))
        self._trim(self._arrivals, t)

    def ended(self, t: float, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        self._ends.append((t, prompt_tokens, cached_tokens, output_tokens))
        self._trim(self._ends, t)

    def _trim(
        self, q: deque[tuple[float, int, int]] | deque[tuple[float, int, int, int]], now: float
    ) -> None:
        while q and q[0][0] < now - self.horizon_s:
            q.popleft()

    def workload(
        self, now: float, span_s: float, quantile: float = 0.9, shares: Sequence[float] = ()
    ) -> Workload:
        """Arrival rate and mean lengths over ``(now - span_s, now]`` (as much of it as is kept),
        the prompt length at ``quantile`` and the mean prompt of the lightest of each of
        ``shares``; zeros (never NaN) when nothing arrived."""
        if span_s <= 0:
            raise ValueError("the window must be > 0 s")
        arrivals = _since(list(self._arrivals), now - span_s, now)
        ends = _since(list(self._ends), now - span_s, now)
        prompt = statistics.fmean(a[1] for a in arrivals) if arrivals else 0.0
        if ends:
            output = statistics.fmean(e[3] for e in ends)
        else:
            output = statistics.fmean(a[2] for a in arrivals) if arrivals else 0.0
        tokens = sum(e[1] for e in ends)
        cached = sum(e[2] for e in ends) / tokens if tokens else 0.0
        tail, light = prompt_shape([a[1] for a in arrivals], quantile, shares)
        # a window past what is kept (the horizon, or the entry cap under a heavy load) is a rate
        # over what is kept, not a lull
        covered = min(span_s, self.horizon_s)
        if len(self._arrivals) == self._arrivals.maxlen and self._arrivals[0][0] > now - covered:
            covered = max(now - self._arrivals[0][0], 1e-9)
        return Workload(len(arrivals) / covered, prompt, output, min(1.0, cached), tail, light, covered)


def rank(n: int, quantile: float) -> int:
    """Where the ``quantile`` of ``n`` sorted values is read (the prompt tail and the measured
    TTFT quantile alike): the ``int(quantile·n)``-th, the last at most."""
    return min(n - 1, int(quantile * n))


def prompt_quantile(prompts: Sequence[float], quantile: float) -> float:
    """The prompt length at ``quantile`` of ``prompts`` (at ``rank``); 0.0 for none."""
    return prompt_shape(prompts, quantile, ())[0]


def prompt_shape(
    prompts: Sequence[float], quantile: float, shares: Sequence[float]
) -> tuple[float, tuple[tuple[float, float], ...]]:
    """``(the prompt length at quantile, light_means at shares)`` of ``prompts``, sorted once."""
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    ordered = sorted(prompts)
    tail = float(ordered[rank(len(ordered), quantile)]) if ordered else 0.0
    return tail, light_means(ordered, shares)


def kept(n: int, share: float) -> int:
    """How many of ``n`` arrivals the lightest ``share`` is: at least that share (rounded up:
    a small window refuses no heavier prompt than the share allows), one at least, of any."""
    if not 0 < share <= 1:
        raise ValueError(f"a share must be in (0, 1], got {share}")
    return min(n, max(1, math.ceil(share * n - 1e-9))) if n else 0


def light_means(ordered: Sequence[float], shares: Sequence[float]) -> tuple[tuple[float, float], ...]:
    """``((share, mean of the lightest share), ...)`` of prompt lengths in ascending order
    (0.0 for none)."""
    out = []
    for share in shares:
        k = kept(len(ordered), share)
        out.append((share, math.fsum(ordered[:k]) / k if k else 0.0))
    return tuple(out)


def _since(rows: list[tuple[float, ...]], lo: float, hi: float) -> list[tuple[float, ...]]:
    times = [r[0] for r in rows]
    return rows[bisect.bisect_right(times, lo) : bisect.bisect_right(times, hi)]
