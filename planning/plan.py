"""``pdserve plan``: which layout of N GPUs serves a workload with the most goodput per GPU.

Candidate families, each judged by the simulator (``pdserve.planning.simulate.simulate``) and a goodput
bisection (the rate doubled until joint attainment falls below 90 %, then bisected):

* **chunked colocation** (Sarathi-Serve / vLLM v1): N colocated engines, decode tokens first
  and prefill chunks filling the step's token budget — one candidate per budget in
  ``--colocated-budgets``, so the best is a tuned chunk budget;
* **prefill-priority colocation** (vLLM v0, DistServe's baseline): N colocated engines whose
  steps are whole prompts or decodes, prompts first — one candidate per ``--priority-budgets``;
* **static splits**: P prefill + (N − P) decode workers under ``--policy`` (least-loaded by
  default), decode workers never prefill. ``--max-splits`` splits spread evenly over 1..N−1
  with every ``--prefill-budgets`` budget, then a local search around the best (its neighbours
  at half the stride, then a quarter, ... down to 1; ``--no-refine`` skips it);
* **conditional** (what ``pdserve serve`` runs by default): the ``goodput`` policy deciding per
  request whether to prefill remotely or on the decode worker, on P = 0 (N colocated engines
  routed by predicted SLO attainment: the member for when no prefill pool pays) and on the
  first pass's splits, every worker with the best chunked-colocation budget (so run after that
  family; ``--no-conditional`` skips it). Its best is compared with the better of the pure
  layouts, per the question "does conditional disaggregation ever lose to a fixed choice?".

* **tensor parallelism** (DistServe's per-phase parallelism): every family above runs at the
  smallest degree the model fits (``--prefill-tp`` / ``--decode-tp`` fix the degrees instead);
  then the best split is tried with the prefill pool at each other degree (the prefill GPUs'
  share held, the worker count just below and above it), then with the decode pool at each
  other degree beside the best prefill degree (and one prefill worker either side of the best
  split found so), and the best colocated layout at each other degree. Degrees are those of 1,
  2, 4, 8 the model fits at and the GPUs hold.

Colocated layouts are candidates like any other, so the answer may be "do not split". A
candidate is first measured at the best goodput of its family so far and stops there if it
misses (``pruned``: its goodput is below that rate); ``--no-prune`` measures all.
The recommendation is the best layout of any family, each runnable by ``pdserve serve`` with
the printed flags (prefill-priority colocation with ``--colocated-schedule prefill-priority``);
the summary also reports the recommendation against prefill-priority colocation, the baseline
DistServe measured against.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.bench.metrics import Slo
from pdserve.bench.sweep import Bracket, Search, search
from pdserve.flags import add_sweep_steps
from pdserve.planning.bound import work_bound
from pdserve.planning.plan_candidates import (
    CHUNKED,
    COLOCATED_BUDGETS,
    PREFILL_BUDGETS,
    PRIORITY_BUDGETS,
    SPLIT,
    Candidate,
    Row,
    candidates,
    coarse_to_fine,
    most_prefill,
    rank,
    split,
    splits,
    tp_neighbours,
)
from pdserve.planning.plan_jobs import SearchPool
from pdserve.planning.plan_report import report
from pdserve.planning.simulate import add_simulate_args, simulate
from pdserve.simulator.calibration import load_sim_profile
from pdserve.simulator.run import workload
from pdserve.steptime.parallel import valid_tp


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_plan_args(p: argparse.ArgumentParser) -> None:
    add_simulate_args(p)
    p.set_defaults(prefill_tp=None, decode_tp=None)  # searched per pool unless given
    p.add_argument("--gpus", type=int, required=True, help="GPUs to lay out")
    p.add_argument("--max-splits", type=int, default=16, help="prefill:decode splits in the first pass")
    p.add_argument("--no-refine", dest="refine", action="store_false", help="no second pass of splits")
    p.add_argument("--colocated-budgets", type=_ints, default=list(COLOCATED_BUDGETS), help="e.g. 512,2048")
    p.add_argument(
        "--priority-budgets",
        type=_ints,
        default=list(PRIORITY_BUDGETS),
        help="prefill-priority colocation budgets ('' for none)",
    )
    p.add_argument("--prefill-budgets", type=_ints, default=list(PREFILL_BUDGETS))
    add_sweep_steps(p)
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="points simulated at once (default: all cores; a job with no candidate to start measures ahead)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds: past it no new candidate starts and running bisections stop (0: none); "
        "what was not measured is listed",
    )
    p.add_argument("--min-rate-per-gpu", type=float, default=1.0, help="first rate of each sweep, per GPU")
    p.add_argument("--no-prune", dest="prune", action="store_false", help="finish every bisection")
    p.add_argument(
        "--exhaustive",
        action="store_true",
        help="the reference search: every candidate's bisection to the end, one at a time, every point "
        "simulated to its last request, no warm starts (what the default search is checked against)",
    )
    p.add_argument(
        "--no-early-stop",
        dest="early_stop",
        action="store_false",
        help="simulate every point to its last request, even once it has certainly passed or failed "
        "90%% (the answers are the same; the exhaustive reference run uses this)",
    )
    p.add_argument(
        "--no-conditional",
        dest="conditional",
        action="store_false",
        help="leave out the conditional family (goodput routing with local prefill)",
    )
    p.add_argument(
        "--floor-per-gpu",
        type=float,
        default=0.0,
        help="do not simulate below this rate per GPU (overloaded layouts simulate slowly): goodput '< rate'",
    )


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


POINT_KEYS = ("slo_attainment", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


@dataclass(frozen=True)
class Stage:
    """Candidates the search releases once ``ready()``: what ``release`` reads of the results
    so far (a family's best) is settled."""

    ready: Callable[[], bool]
    release: Callable[[], list[Candidate]]
    urgent: bool = False  # ahead of what already waits: the search's critical path


def warm_index(start: float, hint: float) -> int:
    """Where to enter the rate grid ``start · 2^k`` for a candidate expected near ``hint``
    req/s: the highest grid rate at or below it (0 without a hint). The search climbs from a
    pass there and descends from a miss, so it measures the points an entry one grid step lower
    would, less one passing point (the slow kind) where goodput reaches the entry rate and
    plus one early-ended miss where goodput is under half of it. It skips one more low rate
    than the lower entry: an answer differs from the search from the bottom only where a
    finite run misses at that rate yet passes above it (not seen in the checks against
    ``--exhaustive``)."""
    k = 0
    while start > 0 and start * 2 ** (k + 1) <= hint:
        k += 1
    return k


def measure_point(args: argparse.Namespace, c: Candidate, rate: float) -> dict[str, Any]:
    """``c`` simulated at ``rate`` req/s (ended early once its 90 % is certain, unless
    ``--no-early-stop``): one point of its goodput search, as the plan reports it."""
    stop_below = 0.9 if getattr(args, "early_stop", True) else None
    m = simulate(
        argparse.Namespace(
            **{**vars(args), **c.sim_args(args.policy), "request_rate": rate, "stop_below": stop_below}
        )
    )
    return {
        "rate": rate,
        "stopped_early": bool(m.get("stopped_early")),
        "wall_s": round(m["simulation_wall_s"], 3),
        "work_bound_per_gpu": m["work_bound_rate_per_gpu"],
        **{k: m[k] for k in POINT_KEYS},
    }


def goodput_search(
    c: Candidate, args: argparse.Namespace, bound: float = 0.0, deadline: float = math.inf, hint: float = 0.0
) -> Search:
    """``c``'s goodput search: the rate doubled from ``--min-rate-per-gpu`` × GPUs until a
    miss, then ``--sweep-steps`` bisections. ``bound`` (the family's best so far) is measured
    first: a miss there ends it (it cannot beat that), as does a next rate under
    ``--floor-per-gpu`` or the deadline: ``pruned``, goodput a lower bound (0: unknown) and
    below ``failed_at``. ``hint`` (req/s, a similar candidate's goodput) enters the doubling
    near it (``search``'s warm start: the same bracket, fewer low rates measured)."""
    floor = getattr(args, "floor_per_gpu", 0.0) * c.gpus
    start = args.min_rate_per_gpu * c.gpus
    return search(
        start,
        12,
        args.sweep_steps,
        stop=lambda hi, mid: mid < floor or time.monotonic() >= deadline,
        first=warm_index(start, hint),
        beat=bound,
    )


def search_result(found: Bracket, points: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "goodput_rate": found.goodput,
        "failed_at": found.failed_at,
        "bracketed": found.bracketed,
        "pruned": found.stopped,
        "points": sorted(points, key=lambda r: r["rate"]),
    }


def _work_bound_rate(args: argparse.Namespace) -> float:
    """The work bound of the plan's workload, req/s over all ``--gpus``."""
    gpus: int = args.gpus
    specs = workload(argparse.Namespace(**{**vars(args), "request_rate": args.min_rate_per_gpu * gpus}))
    return work_bound(load_sim_profile(args.profile), specs, args.block_size).rate_per_gpu * gpus


def degrees(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The degrees the plan tries for the prefill and the decode pool (smallest first): those
    the model fits at and ``--gpus`` holds, or the one ``--prefill-tp`` / ``--decode-tp`` fix."""
    fits = [t for t in valid_tp(load_sim_profile(args.profile)) if t <= args.gpus]
    out = []
    for fixed in (args.prefill_tp, args.decode_tp):
        if fixed is not None and fixed not in fits:
            raise ValueError(
                f"{args.profile} does not run at tp={fixed} on {args.gpus} GPUs: valid degrees "
                f"{', '.join(map(str, fits)) or 'none'}"
            )
        if not fits:
            raise ValueError(f"{args.profile} fits no degree of 1, 2, 4, 8 within {args.gpus} GPUs")
        out.append([fixed] if fixed is not None else fits)
    return out[0], out[1]


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        slo = Slo.parse(args.goodput)
    except ValueError as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    if slo.empty:
        print("pdserve plan: error: --goodput ttft:MS tpot:MS is required", file=sys.stderr)
        return 2
    if args.gpus < 1 or args.jobs < 1:
        print("pdserve plan: error: --gpus and --jobs must be >= 1", file=sys.stderr)
        return 2
    if not (0 <= args.time_budget < math.inf and 0 < args.min_rate_per_gpu < math.inf):  # NaN too
        print(
            "pdserve plan: error: --time-budget must be a finite number >= 0 (0: none) and "
            "--min-rate-per-gpu a finite number > 0",
            file=sys.stderr,
        )
        return 2
    if args.decode_max_num_batched_tokens or not args.local_prefill:
        # Each candidate sets these itself (static splits never prefill locally, conditional
        # ones always do, at the family's budget); silently ignoring the flags would mislead.
        print(
            "pdserve plan: error: --decode-max-num-batched-tokens and --no-local-prefill are chosen per "
            "candidate by plan (see --no-conditional); use pdserve simulate to try one layout",
            file=sys.stderr,
        )
        return 2
    try:
        prefill_degrees, decode_degrees = degrees(args)
    except ValueError as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    bp, bd = prefill_degrees[0], decode_degrees[0]  # every family's first pass
    rows: list[Row] = []
    # family -> best goodput so far (req/s over all --gpus: a layout that leaves GPUs idle scaled up)
    best: dict[str, float] = {}

    def scaled(rate: float, c: Candidate, to_plan: bool = False) -> float:
        """``rate`` of a ``--gpus`` layout as ``c``'s GPUs would hold it (or ``c``'s rate as
        ``--gpus`` would, ``to_plan``); exact where they are the same."""
        gpus: int = args.gpus
        if c.gpus == gpus:
            return rate
        return rate * gpus / c.gpus if to_plan else rate * c.gpus / gpus

    skipped: list[str] = []
    if args.exhaustive:
        args.prune = args.early_stop = False
    warm = not args.exhaustive
    # Where a candidate with nothing measured yet enters the rate grid: near the work bound, the
    # most any layout sustains for long (finite runs pass it a little, overloaded ones fail fast).
    bound_rate = _work_bound_rate(args) if warm else 0.0
    deadline = time.monotonic() + args.time_budget if args.time_budget > 0 else math.inf
    jobs = 1 if args.exhaustive else max(1, args.jobs)

    def progress(c: Candidate, point: dict[str, Any]) -> None:
        _progress(f"    {c.label}: {point['rate']:9.2f} req/s -> attainment {point['slo_attainment']:.3f}")

    todo: list[Candidate] = []

    def pick() -> Candidate:
        # While a family's first candidate runs, its next one would have no best to be
        # pruned against: another family's candidate goes first where there is one.
        busy = {c.family for c in pool.running}
        i = next((i for i, c in enumerate(todo) if c.family in best or c.family not in busy), 0)
        return todo.pop(i)

    def settled(family: str) -> bool:
        """Nothing of ``family`` waits or runs: its results so far are final."""
        return not any(c.family == family for c in (*todo, *pool.running))

    def run(stages: list[Stage]) -> None:
        """Measure what ``stages`` release, ``--jobs`` at a time, each candidate pruned against
        its family's best so far. A stage is released once what it reads is settled; there is
        no barrier between stages, so no job idles while a released candidate waits."""
        while True:
            ready = next((st for st in stages if st.ready()), None)
            while ready is not None:  # in order: a release may unsettle what a later stage reads
                stages.remove(ready)
                more = ready.release()
                todo[:] = [*more, *todo] if ready.urgent else [*todo, *more]
                ready = next((st for st in stages if st.ready()), None)
            if not (todo or pool.running):
                return  # with nothing left to measure every dependency is settled: no stage waits
            while todo and pool.free() > 0:
                c = pick()
                if time.monotonic() >= deadline:
                    skipped.append(c.label)
                    continue
                bound = scaled(best.get(c.family, 0.0), c) if args.prune else 0.0
                known = best.get(c.family) or max(best.values(), default=0.0) or bound_rate
                hint = scaled(known, c) if warm else 0.0
                pool.start(c, functools.partial(goodput_search, c, args, bound, deadline, hint))
            # idle jobs measure ahead only when no candidate waits for one
            for c, found, points in pool.wait(ahead=not todo):
                record(c, search_result(found, points))

    def record(c: Candidate, res: dict[str, Any]) -> None:
        per_gpu = res["goodput_rate"] / c.gpus
        rows.append((per_gpu, c, res))
        best[c.family] = max(best.get(c.family, 0.0), scaled(res["goodput_rate"], c, to_plan=True))
        if res["pruned"] and not res["goodput_rate"]:  # missed the family's best at once
            print(f"  {c.label:<40} goodput < {res['failed_at']:.2f} req/s (pruned)", flush=True)
            return
        if res["pruned"]:
            note = f" (< {res['failed_at']:.2f}, pruned)"
        else:
            note = "" if res["bracketed"] else " (>=)"
        print(
            f"  {c.label:<40} goodput {res['goodput_rate']:8.2f} req/s{note}  {per_gpu:7.3f} per GPU",
            flush=True,
        )

    budgets = (args.colocated_budgets, args.priority_budgets, args.prefill_budgets)
    first = candidates(args.gpus, args.max_splits, *budgets, prefill_tp=bp, decode_tp=bd)
    order = coarse_to_fine if warm else list
    pairs = [c for c in first if not c.colocated]
    coarse = splits(args.gpus, args.max_splits, bp, bd)
    tried = {(c.prefill, c.budget) for c in pairs}
    # The local search around the best split halves its step each round; a round reads the
    # best split of all before it, so it waits for them (and goes ahead of other work: the
    # rounds are the search's critical path).
    step = (coarse[1] - coarse[0]) // 2 if args.refine and len(coarse) > 1 else 0

    def conditional() -> list[Candidate]:
        # on the best chunked-colocation budget: settled by now
        chunked_best = max((r for r in rows if r[1].family == CHUNKED), key=rank, default=None)
        budget = chunked_best[1].budget if chunked_best else max(args.prefill_budgets)
        on = [split(args.gpus, p, budget, bp, bd, conditional=True) for p in coarse]
        return [Candidate(0, 0, args.gpus // bd, budget, conditional=True, decode_tp=bd), *order(on)]

    def refine() -> list[Candidate]:
        nonlocal step
        measured = [r for r in rows if r[1].family == SPLIT]
        if step < 1 or not measured:  # done, or the time budget ended before any split
            return []
        top = max(measured, key=rank)[1].prefill
        near = []
        for p in (top - step, top + step):
            for b in args.prefill_budgets:
                if 0 < p <= most_prefill(args.gpus, bp, bd) and (p, b) not in tried:
                    tried.add((p, b))
                    near.append(split(args.gpus, p, b, bp, bd))
        step //= 2
        if step >= 1:
            stages.append(Stage(lambda: settled(SPLIT), refine, urgent=True))
        return near

    stages = [
        # colocated first (the conditional family needs their best budget), then the splits
        Stage(lambda: True, lambda: [c for c in first if c.colocated] + order(pairs)),
    ]
    if args.conditional:
        stages.append(Stage(lambda: settled(CHUNKED), conditional))
    if step >= 1:
        stages.append(Stage(lambda: settled(SPLIT), refine, urgent=True))

    # Tensor parallelism, one pool at a time once the first pass (and its refinement) settled.
    seen = {c for c in first}

    def idle() -> bool:
        return step < 1 and not todo and not pool.running

    def fresh(cs: list[Candidate]) -> list[Candidate]:
        out = [c for c in dict.fromkeys(cs) if c not in seen]
        seen.update(out)
        return out

    def best_row(colocated: bool) -> Row | None:
        return max((r for r in rows if bool(r[1].colocated) == colocated), key=rank, default=None)

    def tp_prefill() -> list[Candidate]:
        out: list[Candidate] = []
        top = best_row(colocated=False)
        if top is not None:
            out += tp_neighbours(top[1], args.gpus, [(pt, bd) for pt in prefill_degrees[1:]])
        coloc = best_row(colocated=True)
        if coloc is not None:
            c = coloc[1]
            for dt in decode_degrees[1:]:
                out.append(dataclasses.replace(c, colocated=args.gpus // dt, decode_tp=dt))
        return fresh(out)

    def tp_decode() -> list[Candidate]:
        top = best_row(colocated=False)
        if top is None:
            return []
        pt = top[1].prefill_tp
        return fresh(tp_neighbours(top[1], args.gpus, [(pt, dt) for dt in decode_degrees if dt != bd]))

    def tp_refine() -> list[Candidate]:
        """One prefill worker more and one fewer around the best split at other degrees (the
        pairs above held a pool's GPUs: the balance at the new degrees may lie beside it)."""
        top = best_row(colocated=False)
        if top is None or (top[1].prefill_tp, top[1].decode_tp) == (bp, bd):
            return []
        c = top[1]
        near = [split(args.gpus, p, c.budget, c.prefill_tp, c.decode_tp, conditional=c.conditional)
                for p in (c.prefill - 1, c.prefill + 1)]  # fmt: skip
        return fresh([n for n in near if n.prefill >= 1 and n.decode >= 1])

    if len(prefill_degrees) > 1 or len(decode_degrees) > 1:
        stages += [Stage(idle, tp_prefill), Stage(idle, tp_decode), Stage(idle, tp_refine)]
    pool: SearchPool[Candidate] = SearchPool(jobs, functools.partial(measure_point, args), progress)
    try:
        run(stages)
    finally:
        pool.close()
    if not rows:
        print("pdserve plan: error: the time budget ended before any candidate was measured", file=sys.stderr)
        return 1
    report(args, rows, skipped)
    return 0
