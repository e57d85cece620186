"""The serving workers' own step times against the profile fitted to the engine alone (pure).

``pdserve profile`` times the engine in a process of its own on an idle host. Inside the
service the same steps run beside the worker's other threads (output push, KV transport, Ray's
own) and, on a shared host, beside the other workers, the router and the client. The workers'
step logs (``pdserve serve --step-log``, ``model_runtime.engine.step_log``) taken during
calibration traffic — never a load test's own points — say by how much:

- **in-service steps**: over *isolated* steps (no other worker's step overlapping more than
  ``ISOLATED`` of it), steps with prefill work (mixed ones included) and decode-only steps
  apart, a line measured = a + x · predicted (``fit_line``: a constant a step, as the router
  and client taking a core from a multi-threaded step cost, and a factor, as a slower core
  does; a pure factor where the calibration's steps are too alike to tell the two apart):
  ``FittedProfile.service_prefill_s`` / ``service_prefill_x`` and the decode pair;
- **co-activity** (``FittedProfile.decode_coactive_x`` / ``prefill_coactive_x``, defined there):
  the median of measured over the isolated line's time, over steps at least ``COACTIVE``
  overlapped — a decode-only step by another worker's step with prefill work, a step with
  prefill work by any other worker's step.

Medians, because a step log holds the odd step the OS descheduled; a kind with fewer than
``min_steps`` co-active steps keeps co-activity 1 (the counts say so).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from model_runtime.engine.step_log import StepRecord
from model_runtime.latency import FittedProfile

ISOLATED = 0.05  # at most this share of a step overlapped by other workers' steps
COACTIVE = 0.5  # at least this share
BINS = 5  # of isolated steps along predicted time, for the line through their medians
SPAN = 1.5  # predicted times must span this ratio (p99 / p1) for a constant to be told apart


@dataclass(frozen=True)
class ServiceFit:
    """Per step kind, the service's step = ``*_s`` + ``*_x`` x the engine profile's."""

    prefill_x: float  # steps with prefill work (mixed ones included)
    decode_x: float  # decode-only steps
    prefill_coactive_x: float
    decode_coactive_x: float
    prefill_steps: int  # isolated steps each kind's fit rests on
    decode_steps: int
    prefill_coactive_steps: int
    decode_coactive_steps: int
    prefill_s: float = 0.0
    decode_s: float = 0.0


def _overlap(rec: StepRecord, others: Sequence[StepRecord]) -> float:
    """Share of ``rec``'s time during which one of ``others`` ran (capped at 1: the steps of
    several other workers may overlap each other)."""
    if rec.duration <= 0:
        return 0.0
    covered = sum(max(0.0, min(rec.end, o.end) - max(rec.start, o.start)) for o in others)
    return min(1.0, covered / rec.duration)


def fit_line(
    points: Sequence[tuple[float, float]], bins: int = BINS, min_bin: int = 5
) -> tuple[float, float]:
    """``(a, x)`` of measured = a + x * predicted over (predicted, measured) steps.

    The predicted range (1st to 99th percentile) is cut into ``bins`` bins of equal width and
    the line is fitted by least squares through the medians of the bins holding at least
    ``min_bin`` steps, so a step the OS descheduled barely moves it and the many steps of one
    size do not outweigh the few of another. Where fewer than two bins are filled, the range
    is too narrow to tell a constant from a factor (the 99th percentile under ``SPAN`` x the
    1st), or the line would start below zero, the step is a pure factor: the median ratio."""
    ratio = statistics.median(m / p for p, m in points)
    pts = sorted(points)
    lo, hi = pts[len(pts) // 100][0], pts[(99 * len(pts)) // 100][0]
    if hi < SPAN * lo:
        return 0.0, ratio
    width = (hi - lo) / bins
    cut: list[list[tuple[float, float]]] = [[] for _ in range(bins)]
    for p, m in pts:
        if lo <= p <= hi:
            cut[min(bins - 1, int((p - lo) / width))].append((p, m))
    full = [b for b in cut if len(b) >= min_bin]
    if len(full) < 2:
        return 0.0, ratio
    xs = [statistics.median(p for p, _ in b) for b in full]
    ys = [statistics.median(m for _, m in b) for b in full]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - slope * mx
    if a < 0 or slope <= 0:
        return 0.0, ratio
    return a, slope


def fit_service(
    logs: Mapping[str, Sequence[StepRecord]], profile: FittedProfile, min_steps: int = 5
) -> ServiceFit:
    """The fit from the step logs of the workers of one host (worker id -> its steps)."""
    iso: dict[bool, list[tuple[float, float]]] = {True: [], False: []}  # has_prefill -> (pred, meas)
    co: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for wid, steps in logs.items():
        others = [r for w, rs in logs.items() if w != wid for r in rs]
        prefilling = [r for r in others if r.has_prefill]
        for rec in steps:
            predicted = profile.step_time(rec.chunks)
            if predicted <= 0:
                continue
            kind = rec.has_prefill
            shared = _overlap(rec, others)
            if shared <= ISOLATED:
                iso[kind].append((predicted, rec.duration))
            elif (shared if kind else _overlap(rec, prefilling)) >= COACTIVE:
                co[kind].append((predicted, rec.duration))
    for kind, name in ((True, "with prefill work"), (False, "decode-only")):
        if len(iso[kind]) < min_steps:
            raise ValueError(
                f"{len(iso[kind])} isolated steps {name} in the step logs; at least {min_steps} needed "
                "(calibration traffic must include requests alone on the host)"
            )
    (pa, px), (da, dx) = fit_line(iso[True]), fit_line(iso[False])

    def coactive(kind: bool, a: float, x: float) -> float:
        if len(co[kind]) < min_steps:
            return 1.0
        return max(1.0, statistics.median(m / (a + x * p) for p, m in co[kind]))

    return ServiceFit(
        prefill_x=px,
        decode_x=dx,
        prefill_coactive_x=coactive(True, pa, px),
        decode_coactive_x=coactive(False, da, dx),
        prefill_steps=len(iso[True]),
        decode_steps=len(iso[False]),
        prefill_coactive_steps=len(co[True]),
        decode_coactive_steps=len(co[False]),
        prefill_s=pa,
        decode_s=da,
    )


def apply_fit(profile: FittedProfile, fit: ServiceFit) -> FittedProfile:
    """The engine's profile as the service runs it: whole steps scaled by kind (as they were
    measured), co-activity set."""
    return dataclasses.replace(
        profile,
        name=f"{profile.name}+service",
        service_prefill_x=fit.prefill_x,
        service_decode_x=fit.decode_x,
        service_prefill_s=fit.prefill_s,
        service_decode_s=fit.decode_s,
        prefill_coactive_x=fit.prefill_coactive_x,
        decode_coactive_x=fit.decode_coactive_x,
    )
