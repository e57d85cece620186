"""The serving workers' own step times against the profile fitted to the engine alone (pure).

``pdserve profile`` times the engine in a process of its own on an idle host. Inside the
service the same steps run beside the worker's other threads (output push, KV transport, Ray's
own) and, on a shared host, beside the other workers, the router and the client. The workers'
step logs (``pdserve serve --step-log``, ``pdserve.model_runtime.engine.step_log``) taken during
calibration traffic — never a load test's own points — say by how much:

- **in-service steps**: over *isolated* steps (no other worker's step overlapping more than
  ``ISOLATED`` of it), steps with prefill work (mixed ones included) and decode-only steps
  apart, a line measured = a + x · predicted (``fit_line``: a constant a step, as the router
  and client taking a core from a multi-threaded step cost, and a factor, as a slower core
  does; a pure factor where the calibration's steps are too alike to tell the two apart):
  ``HostCalibration.prefill_s`` / ``prefill_x`` and the decode pair
  (``pdserve.simulator.calibration``);
- **co-activity** (``HostCalibration.decode_coactive_x`` / ``prefill_coactive_x``):
  the median of measured over the isolated line's time, over steps at least ``COACTIVE``
  overlapped — a decode-only step by another worker's step with prefill work, a step with
  prefill work by any other worker's step;
- **step-time variability** (``HostCalibration.prefill_jitter`` / ``decode_jitter`` /
  ``jitter_corr``, ``pdserve.simulator.jitter``): how every step scatters around the calibrated model,
  and how long slow stretches last.

``host_speed`` measures, over any window of the service's steps (a load test's point, say), how
much slower the host ran than in the calibration, for ``HostCalibration.at_speed`` to apply: on
a shared VM the host's speed drifts by more between runs than the effects the simulator is
checked for.

Medians, because a step log holds the odd step the OS descheduled; a kind with fewer than
``min_steps`` co-active steps keeps co-activity 1 (the counts say so).
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from pdserve.model_runtime.engine.step_log import StepRecord
from pdserve.simulator.calibration import Calibrated, HostCalibration, calibration_of
from pdserve.simulator.jitter import fit_jitter
from pdserve.steptime.model import StepTimeModel

ISOLATED = 0.05  # at most this share of a step overlapped by other workers' steps
COACTIVE = 0.5  # at least this share
BINS = 5  # of isolated steps along predicted time, for the line through their medians
SPAN = 1.5  # predicted times must span this ratio (p99 / p1) for a constant to be told apart


@dataclass(frozen=True)
class ServiceFit:
    """The host calibration the step logs gave, and how many steps each part rests on."""

    calibration: HostCalibration
    prefill_steps: int  # isolated steps each kind's line rests on
    decode_steps: int
    prefill_coactive_steps: int
    decode_coactive_steps: int


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


def _beside(
    logs: Mapping[str, Sequence[StepRecord]],
) -> Iterator[tuple[str, Sequence[StepRecord], list[StepRecord], list[StepRecord]]]:
    """Each worker's steps with the other workers' steps, and those of them with prefill work."""
    for wid, steps in logs.items():
        others = [r for w, rs in logs.items() if w != wid for r in rs]
        yield wid, steps, others, [r for r in others if r.has_prefill]


def _steps(logs: Mapping[str, Sequence[StepRecord]]) -> Iterator[tuple[str, StepRecord, float, float]]:
    """Each worker's steps in order with the share of each that other workers' steps overlapped
    and the share that other workers' steps with prefill work overlapped."""
    for wid, steps, others, prefilling in _beside(logs):
        for rec in steps:
            yield wid, rec, _overlap(rec, others), _overlap(rec, prefilling)


def _coactive(rec: StepRecord, shared: float, shared_prefill: float) -> bool:
    return (shared if rec.has_prefill else shared_prefill) >= COACTIVE


def _running_at(t: float, others: Sequence[StepRecord]) -> bool:
    return any(o.start <= t < o.end for o in others)


def residuals(
    logs: Mapping[str, Sequence[StepRecord]], model: StepTimeModel
) -> dict[str, list[tuple[bool, float]]]:
    """Worker id -> its steps in order as ``(has prefill work, measured / modelled)``, modelled
    as the simulator models a step of a service on this host: ``model``'s step (without the
    per-step cost outside the forward pass, which a step log does not see), times its
    co-activity factor where the simulator would apply it — by what the other workers run at
    the step's start (``pdserve.simulator.cluster.Cluster.coactivity``). Steps of no duration (a
    clock's tick) are left out."""
    cal = calibration_of(model)
    forward = Calibrated(model.base if isinstance(model, Calibrated) else model,
                         dataclasses.replace(cal, step_overhead_s=0.0))  # fmt: skip
    out: dict[str, list[tuple[bool, float]]] = {w: [] for w in logs}
    for wid, steps, others, prefilling in _beside(logs):
        for rec in steps:
            modelled = forward.step_time(rec.chunks)
            if modelled <= 0 or rec.duration <= 0:
                continue
            modelled *= cal.coactivity(
                rec.has_prefill, _running_at(rec.start, others), _running_at(rec.start, prefilling)
            )
            out[wid].append((rec.has_prefill, rec.duration / modelled))
    return out


def fit_service(
    logs: Mapping[str, Sequence[StepRecord]], profile: StepTimeModel, min_steps: int = 5
) -> ServiceFit:
    """The fit from the step logs of the workers of one host (worker id -> its steps), against
    the engine's own ``profile``."""
    iso: dict[bool, list[tuple[float, float]]] = {True: [], False: []}  # has_prefill -> (pred, meas)
    co: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _, rec, shared, shared_prefill in _steps(logs):
        predicted = profile.step_time(rec.chunks)
        if predicted <= 0:
            continue
        if shared <= ISOLATED:
            iso[rec.has_prefill].append((predicted, rec.duration))
        elif _coactive(rec, shared, shared_prefill):
            co[rec.has_prefill].append((predicted, rec.duration))
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

    cal = HostCalibration(
        prefill_x=px,
        decode_x=dx,
        prefill_s=pa,
        decode_s=da,
        prefill_coactive_x=coactive(True, pa, px),
        decode_coactive_x=coactive(False, da, dx),
    )
    pj, dj, rho = fit_jitter(list(residuals(logs, Calibrated(profile, cal)).values()))
    return ServiceFit(
        calibration=dataclasses.replace(cal, prefill_jitter=pj, decode_jitter=dj, jitter_corr=rho),
        prefill_steps=len(iso[True]),
        decode_steps=len(iso[False]),
        prefill_coactive_steps=len(co[True]),
        decode_coactive_steps=len(co[False]),
    )


def host_speed(
    logs: Mapping[str, Sequence[StepRecord]], model: StepTimeModel, min_steps: int = 5
) -> tuple[float, float]:
    """``(steps with prefill work, decode-only steps)``: the median of measured / modelled over
    a window of the service's steps, against a calibrated model (``apply_fit``): how much
    slower (> 1) or faster the host ran in that window than in the calibration
    (``HostCalibration.at_speed`` applies it). A kind with fewer than ``min_steps`` steps in
    the window is 1."""
    ratios: dict[bool, list[float]] = {True: [], False: []}
    for seq in residuals(logs, model).values():
        for kind, ratio in seq:
            ratios[kind].append(ratio)
    for kind, name in ((True, "with prefill work"), (False, "decode-only")):
        if len(ratios[kind]) < min_steps:
            warnings.warn(
                f"{len(ratios[kind])} steps {name} in the window: that kind keeps the calibration's speed",
                stacklevel=2,
            )
    speed = {k: statistics.median(v) if len(v) >= min_steps else 1.0 for k, v in ratios.items()}
    return speed[True], speed[False]


def apply_fit(profile: StepTimeModel, fit: ServiceFit) -> Calibrated:
    """The engine's profile as the service runs it."""
    return Calibrated(profile, fit.calibration)
