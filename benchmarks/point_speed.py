"""The host's speed during each point of a real sweep, from the sweep server's step log
(``benchmarks/sim_validation.py``).

A profile calibrated before a sweep predicts the sweep only as well as the host keeps its
speed. On a shared VM it does not: the same service's steps ran 3-14 % slower in one run's
sweep than in its calibration an hour earlier, and by different amounts from run to run. The
sweep server's step log (``pdserve serve --step-log``) records every step a point ran, so the
host's speed during that point can be measured (``pdserve.simulator.service_fit.host_speed``: the
median of measured over modelled, by step kind) and the calibrated profile set to it
(``HostCalibration.at_speed``): two numbers a point, measured from step durations alone, never
from a request's latency or outcome. They are conditioning, not prediction: a median over all of
a point's steps also absorbs whatever load-dependent error the model has at that rate (co-active steps, the
steps slowed by a KV arrival). The second profile of each point goes further and replaces the calibration's
step-time distribution (``pdserve.simulator.jitter``'s grids and correlation) with the point's own —
the host's noise during the point, and the model's residuals there with it.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.model_runtime.engine.step_log import StepRecord

TAIL_S = 30.0  # after a point's last prompt, its last requests still decode


def _first_prefills(steps: Sequence[StepRecord]) -> list[float]:
    """Start times of the steps that began a prompt (a chunk of more than one token at position
    0), one per request; the sweep's prompts share no prefix, so none starts from the cache."""
    return [r.start for r in steps for new, cached in r.chunks if cached == 0 and new > 1]


def point_windows(
    points: Sequence[Mapping[str, Any]], logs: Mapping[str, Sequence[StepRecord]], num_prompts: int
) -> list[tuple[float, float]] | None:
    """Each point's ``[start, end)`` on the host's monotonic clock, in the order the points ran.

    Points record their own window (``mono``); runs from before that are cut by counting the
    requests the step log began: the points ran one after another on one server,
    ``num_prompts`` each. ``None`` where neither works (the counts do not add up)."""
    if all("mono" in p for p in points):
        return [(float(p["mono"][0]), float(p["mono"][1])) for p in points]
    starts = sorted(t for steps in logs.values() for t in _first_prefills(steps))
    if len(starts) != len(points) * num_prompts:
        return None
    firsts = starts[::num_prompts]
    out: list[tuple[float, float]] = []
    for i, t0 in enumerate(firsts):
        last = starts[(i + 1) * num_prompts - 1]
        end = firsts[i + 1] if i + 1 < len(firsts) else last + TAIL_S
        out.append((max(t0 - 1.0, out[-1][1]) if out else t0 - 1.0, end))  # no step in two points
    return out


def window(
    logs: Mapping[str, Sequence[StepRecord]], span: tuple[float, float]
) -> dict[str, list[StepRecord]]:
    """The steps of each worker that started within ``span``."""
    out = {}
    for wid, steps in logs.items():
        starts = [r.start for r in steps]
        out[wid] = list(steps[bisect.bisect_left(starts, span[0]) : bisect.bisect_left(starts, span[1])])
    return out


def point_profiles(
    real: Mapping[str, Any], calibrated: Mapping[str, str], steps_root: Path, out_dir: Path, num_prompts: int
) -> tuple[dict[str, dict[float, str]], dict[str, dict[float, str]], dict[str, list[dict[str, float]]]]:
    """For each layout whose sweep left a step log, each point's calibrated profile at the
    host speed of that point, and the same with the point's steps also replacing the
    calibration's step-time variability (how they scattered around the profile at that speed:
    the host's noise during the point) — both layout -> rate -> path, written to ``out_dir`` —
    and what was measured of each point."""
    import dataclasses

    from pdserve.model_runtime.engine.step_log import read_dir
    from pdserve.simulator.calibration import Calibrated, load_sim_profile
    from pdserve.simulator.jitter import fit_jitter
    from pdserve.simulator.service_fit import host_speed, residuals

    speed_paths: dict[str, dict[float, str]] = {}
    noise_paths: dict[str, dict[float, str]] = {}
    hosts: dict[str, list[dict[str, float]]] = {}
    for layout, res in real["layouts"].items():
        prof = load_sim_profile(calibrated[layout])
        logs = read_dir(steps_root / f"{layout}-sweep")
        if not isinstance(prof, Calibrated) or not logs:
            continue
        spans = point_windows(res["points"], logs, num_prompts)
        if spans is None:
            print(f"{layout}: the sweep's step log does not split into its points; no per-point speed")
            continue
        for pt, span in zip(res["points"], spans, strict=True):
            steps = window(logs, span)
            prefill, decode = host_speed(steps, prof)
            at = prof.with_calibration(prof.calibration.at_speed(prefill, decode))
            pj, dj, rho = fit_jitter(list(residuals(steps, at).values()))
            noisy = at.with_calibration(
                dataclasses.replace(at.calibration, prefill_jitter=pj, decode_jitter=dj, jitter_corr=rho)
            )
            for paths, kind, p in ((speed_paths, "at", at), (noise_paths, "scatter", noisy)):
                path = out_dir / f"{prof.name}-{layout}-{kind}-{pt['rate']:.3f}.json"
                path.write_text(p.to_json() + "\n")
                paths.setdefault(layout, {})[pt["rate"]] = str(path)
            q90 = dj[round(0.9 * (len(dj) - 1))] if dj else 1.0  # the grid's probabilities run 0..1
            host = {"rate": pt["rate"], "prefill_x": prefill, "decode_x": decode, "decode_q90": q90}
            hosts.setdefault(layout, []).append(host)
            print(
                f"{layout} {pt['rate']:.3f} req/s: host speed x{prefill:.3f} prefill, x{decode:.3f} decode; "
                f"decode steps' 90th percentile x{q90:.3f} the median"
            )
    return speed_paths, noise_paths, hosts
