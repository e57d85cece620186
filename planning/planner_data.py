"""The pool planner's data: its configuration, what it observes of an interval and what it
decides (``pdserve.planning.planner`` holds the decision itself). Pure: the router's autoscaler,
both simulators and the flags share these."""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field, replace

from pdserve.planning.capacity import Prediction
from pdserve.router.workload_window import Workload


class Reason(enum.Enum):
    HOLD = "hold"
    SCALE_UP = "scale_up"  # the current layout misses: grow at once
    SWITCH = "switch"  # move workers between the pools (same total)
    SCALE_DOWN = "scale_down"  # a smaller layout has met the SLO with margin for a while
    OVERLOADED = "overloaded"  # nothing within the bounds meets: the largest layout
    WARMING = "warming"  # new workers still warming up: their steps do not count yet


@dataclass(frozen=True)
class Bounds:
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_prefill <= self.max_prefill or not 1 <= self.min_decode <= self.max_decode:
            raise ValueError(f"pool bounds need 1 <= min <= max for each pool, got {self}")

    def clamp(self, layout: Layout) -> Layout:
        return Layout(
            min(self.max_prefill, max(self.min_prefill, layout.prefill)),
            min(self.max_decode, max(self.min_decode, layout.decode)),
        )


@dataclass(frozen=True, order=True)
class Layout:
    prefill: int
    decode: int

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


def moves(have: Layout, target: Layout) -> tuple[int, tuple[int, int]]:
    """How the pools get from ``have`` to ``target``: ``(switched, (prefill, decode))`` —
    workers moved from the decode pool into the prefill pool (negative: the other way), then
    workers started (> 0) or stopped (< 0) in each pool. A move between the pools comes
    before a stop and a start: the switched worker keeps its weights and KV pool."""
    dp, dd = target.prefill - have.prefill, target.decode - have.decode
    switched = min(dp, -dd) if dp > 0 > dd else (-min(-dp, dd) if dd > 0 > dp else 0)
    return switched, (dp - switched, dd + switched)


# looks an interval (both autoscalers'): the last decides, the others may only grow the pools
CHECKS = 3


@dataclass(frozen=True)
class PlannerConfig:
    ttft_s: float  # the SLO's targets (a quantile of each, ``quantile``)
    tpot_s: float
    bounds: Bounds = field(default_factory=Bounds)
    quantile: float = 0.9  # the attainment target, and the TTFT quantile that must meet it
    margin: float = 0.75  # a smaller layout must predict at most this share of each target
    # a window that measured the serving layout's tail within this share of its target outranks
    # the tail the model predicts for that layout (``Planner._measured_within``): a tail that
    # met the target on most of the window's arrivals is a fact about this load
    trust: float = 1.0
    down_after: int = 3  # intervals whose loads (and checks) a smaller layout must meet
    cooldown: int = 2  # intervals after a change before the next scale-down
    # an interval whose every window carries less than this share of the busiest one remembered
    # (arrivals a second) starts the memory afresh: the load fell, and the windows before the
    # fall are no reason to hold the workers it left idle (0: always remember ``down_after``)
    forget_below: float = 0.5
    # a check window carrying this many times the busiest window of the intervals remembered is
    # a step in the load: a tail predicted over its target grows the pools at once, without
    # waiting for a measured miss or the decision (``Planner._stepped``; inf: never)
    step_above: float = 1.5
    min_requests: int = 20  # a window with fewer ended requests says nothing about attainment
    headroom: float = 0.1  # a layout moved to keeps up with every recent check window plus this share
    # the window length ``headroom`` is sized for (the checks': the interval / ``CHECKS``); a
    # window ``k`` times as long gets ``headroom / sqrt(k)``: its rate strays less from the next
    # one's (decode's windows run to 90 s, and a tenth over the busiest of them priced a worker
    # the SLO never needed)
    headroom_span_s: float = 10.0
    # the most of the arrivals the planner counts on the router refusing (admission ``reject``:
    # it refuses what is predicted to miss, the longest prompts first), out of the 1 - quantile
    # the SLO allows to miss; 0 sizes the pools to serve every request
    shed: float = 0.0
    # spending the SLO's error budget: the requests that met beyond ``quantile`` over the last
    # ``budget_intervals`` decisions are banked, and growing or holding may size the next
    # interval for a lower quantile whose extra misses spend up to ``spend`` of the bank (never
    # below ``quantile`` less the SLO's own allowance); 0 sizes every interval for ``quantile``
    spend: float = 0.0
    budget_intervals: int = 20
    # a decode step's most requests (the engine's ``max_num_seqs``); None: what the KV pool holds
    max_seqs: int | None = None
    # the decision windows whose measured decode the step-time correction is fitted to
    # (``step_correction.fit_decode``: windows at other loads tell a fixed cost a step apart
    # from a factor on it)
    fit_windows: int = 10

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError("the planner needs both a TTFT and a TPOT target (> 0)")
        if not 0 < self.margin <= 1 or not 0 < self.quantile < 1 or not 0 <= self.headroom <= 10:
            raise ValueError("margin must be in (0, 1], quantile in (0, 1) and headroom in [0, 10]")
        if not 0 <= self.trust <= 1:
            raise ValueError(f"trust must be in [0, 1] (0: never trust a measured tail), got {self.trust}")
        if not self.headroom_span_s > 0 or not math.isfinite(self.headroom_span_s):
            raise ValueError(f"headroom_span_s must be a finite number > 0, got {self.headroom_span_s}")
        if self.down_after < 1 or self.cooldown < 0:
            raise ValueError("down_after must be >= 1 and cooldown >= 0")
        if not self.step_above > 1:
            raise ValueError(f"step_above must be > 1, got {self.step_above}")
        if not 0 <= self.forget_below < 1:
            raise ValueError(f"forget_below must be in [0, 1), got {self.forget_below}")
        if not (self.shed == 0 or 1e-3 <= self.shed < 1 - self.quantile):
            raise ValueError(f"shed must be 0 or in [0.001, 1 - quantile), got {self.shed}")
        if not 0 <= self.spend <= 1 or self.budget_intervals < 2:
            raise ValueError(f"spend must be in [0, 1] and budget_intervals >= 2, got {self.spend}")
        if self.spend and self.quantile <= 0.5:
            raise ValueError("spending the error budget needs an attainment target above 0.5")
        if self.max_seqs is not None and self.max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {self.max_seqs}")
        if self.fit_windows < 1:
            raise ValueError(f"fit_windows must be >= 1, got {self.fit_windows}")

    @functools.cached_property
    def shares(self) -> tuple[float, ...]:
        """The admitted shares a layout is priced at besides all (``Workload.light`` is
        measured at these): ``shed`` in four steps, the largest refusal last."""
        if not self.shed:
            return ()
        return tuple(round(1 - self.shed * k / 4, 9) for k in range(1, 5))


@dataclass(frozen=True)
class Observation:
    """One interval as the router saw it."""

    t: float
    layout: Layout  # the workers serving now
    load: Workload
    # ended in the window, of those that arrived once the serving workers took their present
    # form (attainment's sample): a request that arrived before a change measures the layout it
    # arrived under — after a long decode, one a few intervals old — not this one
    requests: int = 0
    attainment: float = math.nan  # share of them that met the SLO
    ttft_s: float = math.nan  # measured at the planner's quantile
    tpot_s: float = math.nan  # measured median
    factors: tuple[float, float] = (1.0, 1.0)  # the router's prefill and decode corrections
    warming: bool = False  # a worker joined recently: its first steps are not the steady state
    # the arrivals over ``LoadMemory.decode_span`` when that is longer than ``load``'s window: what
    # the decode pool is sized for (``capacity.predict``'s ``decode_load``); None: ``load``
    decode_load: Workload | None = None
    # every request that ended in the window and the share that met, whatever layout it arrived
    # under: what the SLO counts (the error budget's bank, reports); None: ``requests`` are all
    ended: tuple[int, float] | None = None

    @property
    def served(self) -> tuple[int, float]:
        """(requests, attainment) of every request that ended in the window."""
        return self.ended if self.ended is not None else (self.requests, self.attainment)

    @property
    def decode(self) -> Workload:
        """The load the decode pool is priced for."""
        return self.load if self.decode_load is None else self.decode_load

    def now(self, obs: Observation) -> Observation:
        """This window's loads as seen at ``obs`` (its layout, corrections and warm-up)."""
        return replace(obs, load=self.load, decode_load=self.decode_load)


@dataclass(frozen=True)
class Decision:
    t: float
    reason: Reason
    layout: Layout  # where the pools go (== the current layout for HOLD)
    predicted: Prediction
    detail: str = ""

    @property
    def changes(self) -> bool:
        return self.reason in (Reason.SCALE_UP, Reason.SWITCH, Reason.SCALE_DOWN, Reason.OVERLOADED)
