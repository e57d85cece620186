"""``--autoscale``'s flags, which ``pdserve serve`` and ``pdserve simulate`` share, and the
planner's settings they make (``PlannerConfig``); pure: argparse only."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from pdserve.planning.planner_data import CHECKS, Bounds, PlannerConfig


def add_autoscale(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="resize the prefill and decode pools with the SLO planner (needs TTFT and TPOT targets)",
    )
    for role in ("prefill", "decode"):
        p.add_argument(f"--min-{role}", type=int, default=1, help=f"with --autoscale: fewest {role} workers")
        p.add_argument(f"--max-{role}", type=int, default=8, help=f"with --autoscale: most {role} workers")
    p.add_argument(
        "--autoscale-interval", type=float, default=30.0, help="seconds between the planner's decisions"
    )
    p.add_argument(
        "--autoscale-shed",
        type=float,
        default=None,
        help="with --autoscale: the most of the requests the planner counts on the router refusing "
        f"at peak, longest prompts first (default: {AUTO_SHED:g} of the SLO's allowed misses when the "
        "SLO's admission is reject, else 0)",
    )
    p.add_argument(
        "--autoscale-spend",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="with --autoscale: spend the SLO's error budget — size each interval for a lower "
        "attainment while the last 20 intervals banked requests met beyond it, up to SHARE of the bank "
        "an interval (default 0: every interval sized for the SLO's attainment)",
    )


# With admission ``reject`` the planner may count on refusing up to this share of the misses
# the SLO allows (the heaviest prompts, at peak); the rest is the served requests' own margin.
AUTO_SHED = 0.8


def planner_bounds(args: argparse.Namespace) -> Bounds:
    return Bounds(args.min_prefill, args.max_prefill, args.min_decode, args.max_decode)


def planner_settings(
    args: argparse.Namespace, ttft_s: float, tpot_s: float, refuses: bool, max_seqs: int
) -> PlannerConfig:
    """``--autoscale``'s planner for the targets; ``refuses``: the router refuses a request
    predicted to miss (admission ``reject``), the only way a request is shed; ``max_seqs``: the
    decode workers' ``max_num_seqs`` as their engines resolved it (a decode worker's batch cap)."""
    spend = getattr(args, "autoscale_spend", 0.0)
    if not 0 <= spend <= 1:
        raise ValueError(f"--autoscale-spend must be a share in [0, 1], got {spend}")
    config = PlannerConfig(ttft_s, tpot_s, planner_bounds(args), spend=spend, max_seqs=max_seqs)
    # ``headroom`` is sized for the checks' windows: the interval over the looks it takes
    interval = getattr(args, "autoscale_interval", None)
    if interval is not None and 0 < interval < math.inf:
        config = replace(config, headroom_span_s=interval / CHECKS)
    shed = getattr(args, "autoscale_shed", None)
    if shed is None:
        return replace(config, shed=AUTO_SHED * (1 - config.quantile) if refuses else 0.0)
    config = replace(config, shed=shed)  # checked first: a bad share says so, admission or not
    if shed and not refuses:
        raise ValueError("--autoscale-shed counts on the router refusing requests: it needs admission reject")
    return config
