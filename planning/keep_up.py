"""The pool planner's keep-up floor: the fewest workers each pool needs so that its queue does
not grow without end under any window the planner remembers (pure).

"Keeps up": each pool at least the fewest workers predicted to keep up with every window the
checks of the last ``down_after`` intervals saw, plus ``headroom`` — at scale a 10 s window
carries a fifth more than its interval's mean, and a layout sized for one window would be
moved again by the next (the busiest for prefill is not the busiest for decode). Decode reads
each look's longer window (``LoadMemory.decode_span``: as long as a request decodes at the TPOT
target): a prefill queue costs TTFT at once, while a decode pool rides out a burst shorter than
that in its batch and queue, and sized for every 10 s burst it held workers the SLO never
needed. The headroom shrinks with the square root of a window's length past
``headroom_span_s``: the busiest of the 90 s decode windows plus a tenth put a decode worker
past its batch cap where the static layout served the same peak on one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

from pdserve.planning.capacity import Prediction
from pdserve.planning.planner_data import Layout, Observation, PlannerConfig
from pdserve.router.workload_window import Workload

# a layout's corrected prediction for an observation's loads, refusing up to a share of them
Predict = Callable[[Observation, Layout, float], Prediction]


def more(config: PlannerConfig, load: Workload) -> float:
    """The factor on ``load``'s rate a layout must keep up with: ``headroom`` for a window up
    to ``headroom_span_s`` long (or of unknown length), shrinking with the square root of a
    longer one's length — the share by which the count of independent arrivals strays from its
    mean falls so, and a busiest window of 90 s is already most of a burst."""
    longer = max(1.0, load.span_s / config.headroom_span_s)
    return 1 + config.headroom / math.sqrt(longer)


def fewest_passing(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The least ``n`` in [lo, hi] with ``ok(n)``, ``ok`` monotone in ``n``; None when even
    ``hi`` fails."""
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def fewest(
    config: PlannerConfig, windows: Iterable[Observation], obs: Observation, predict: Predict, shed: float
) -> tuple[int, int]:
    """The fewest prefill and decode workers that keep up with each of ``windows`` plus its
    headroom, priced as at ``obs`` (its corrections), prefill counting on refusals up to
    ``shed``. Prefill and decode are predicted apart: each pool's feasibility is the other's at
    its largest, and grows with the pool."""
    b = config.bounds

    def least(lo: int, hi: int, keeps_up: Callable[[int], bool]) -> int:
        n = fewest_passing(lo, hi, keeps_up)
        return hi if n is None else n  # none keeps up: the most there may be

    p = d = 0
    for w in windows:
        if w.load.rate == 0 and w.decode.rate == 0:
            continue
        o = replace(obs, load=replace(w.load, rate=w.load.rate * more(config, w.load)))
        o = replace(o, decode_load=replace(w.decode, rate=w.decode.rate * more(config, w.decode)))

        def prefill_ok(n: int, o: Observation = o) -> bool:
            return math.isfinite(predict(o, Layout(n, b.max_decode), shed).ttft_s)

        def decode_ok(n: int, o: Observation = o) -> bool:
            # refusals spare prefill only: decode is priced serving everyone
            return math.isfinite(predict(o, Layout(b.max_prefill, n), 0.0).tpot_s)

        p = max(p, least(b.min_prefill, b.max_prefill, prefill_ok))
        d = max(d, least(b.min_decode, b.max_decode, decode_ok))
    return p, d
