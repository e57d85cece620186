"""The serving workers' own step times against the profile fitted to the engine alone (pure).

``pdserve profile`` times the engine in a process of its own on an idle host. Inside the
service the same steps run beside the worker's other threads (output push, KV transport, Ray's
own) and, on a shared host, beside the other workers, the router and the client. The workers'
step logs (``pdserve serve --step-log``, ``model_runtime.engine.step_log``) taken during
calibration traffic — never a load test's own points — say by how much:

- **in-service factors**: the median of measured / predicted step time over *isolated* steps
  (no other worker's step overlapping more than ``ISOLATED`` of it), steps with prefill work
  (mixed ones included) and decode-only steps apart; they scale the profile's whole steps of
  each kind (``FittedProfile.service_prefill_x`` / ``service_decode_x``);
- **co-activity** (``FittedProfile.decode_coactive_x`` / ``prefill_coactive_x``, defined there):
  the same median over steps at least ``COACTIVE`` overlapped — a decode-only step by another
  worker's step with prefill work, a step with prefill work by any other worker's step —
  divided by the isolated factor of its kind.

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


@dataclass(frozen=True)
class ServiceFit:
    prefill_x: float  # in-service step / engine profile, steps with prefill work
    decode_x: float  # the same, decode-only steps
    prefill_coactive_x: float
    decode_coactive_x: float
    prefill_steps: int  # isolated steps each factor rests on
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


def fit_service(
    logs: Mapping[str, Sequence[StepRecord]], profile: FittedProfile, min_steps: int = 5
) -> ServiceFit:
    """Factors from the step logs of the workers of one host (worker id -> its steps)."""
    iso: dict[bool, list[float]] = {True: [], False: []}  # has_prefill -> measured / predicted
    co: dict[bool, list[float]] = {True: [], False: []}
    for wid, steps in logs.items():
        others = [r for w, rs in logs.items() if w != wid for r in rs]
        prefilling = [r for r in others if r.has_prefill]
        for rec in steps:
            predicted = profile.step_time(rec.chunks)
            if predicted <= 0:
                continue
            ratio = rec.duration / predicted
            kind = rec.has_prefill
            if _overlap(rec, others) <= ISOLATED:
                iso[kind].append(ratio)
            elif _overlap(rec, others if kind else prefilling) >= COACTIVE:
                co[kind].append(ratio)
    for kind, name in ((True, "with prefill work"), (False, "decode-only")):
        if len(iso[kind]) < min_steps:
            raise ValueError(
                f"{len(iso[kind])} isolated steps {name} in the step logs; at least {min_steps} needed "
                "(calibration traffic must include requests alone on the host)"
            )
    px, dx = statistics.median(iso[True]), statistics.median(iso[False])

    def coactive(kind: bool, base: float) -> float:
        return max(1.0, statistics.median(co[kind]) / base) if len(co[kind]) >= min_steps else 1.0

    return ServiceFit(
        prefill_x=px,
        decode_x=dx,
        prefill_coactive_x=coactive(True, px),
        decode_coactive_x=coactive(False, dx),
        prefill_steps=len(iso[True]),
        decode_steps=len(iso[False]),
        prefill_coactive_steps=len(co[True]),
        decode_coactive_steps=len(co[False]),
    )


def apply_fit(profile: FittedProfile, fit: ServiceFit) -> FittedProfile:
    """The engine's profile as the service runs it: whole steps scaled by kind (as they were
    measured), co-activity set."""
    return dataclasses.replace(
        profile,
        name=f"{profile.name}+service",
        service_prefill_x=fit.prefill_x,
        service_decode_x=fit.decode_x,
        prefill_coactive_x=fit.prefill_coactive_x,
        decode_coactive_x=fit.decode_coactive_x,
    )
