"""What a serving host adds to a step-time model: the simulator's host calibration (pure).

A profile describes an engine (``pdserve.steptime``). The serving worker's steps also carry
what the host around the engine costs, measured from the running service's step logs
(``pdserve.simulator.service_fit``) and applied only by the simulator:

- ``step_overhead_s`` is added to every step: what a serving worker spends per step beyond the
  engine's own ``step()`` (its loop, output push, transfer polling, and the router and client
  sharing its cores);
- ``prefill_s`` + ``prefill_x`` · t and ``decode_s`` + ``decode_x`` · t turn the engine's step
  ``t`` into the serving worker's: a step with prefill work (mixed steps included) takes the
  first, a decode-only step the second — whole steps, as the step logs measure them, because
  what slows a serving worker's step does not split along the prefill and decode parts: a
  constant a step (the router and client taking a core from a multi-threaded step) and a
  factor (a slower core, the worker's other threads);
- ``decode_coactive_x`` / ``prefill_coactive_x`` describe workers that share one host (its
  cores, caches and memory system): a decode-only step takes ``decode_coactive_x`` times as
  long while another worker on the host runs a step with prefill work, and a step with prefill
  work ``prefill_coactive_x`` times as long while another worker steps at all. GPUs do not
  share like that; the simulator applies them only to a deployment it is told shares a host
  (``--shared-host``);
- ``prefill_jitter`` / ``decode_jitter`` and ``jitter_corr``: how the serving worker's real
  steps scatter around all of the above (quantiles of measured / modelled at equally spaced
  probabilities, median 1; and how long slow stretches last). The simulator draws each step's
  factor from them (``pdserve.simulator.jitter``): SLO attainment is decided in the tails a
  deterministic step time does not have.

``Calibrated`` wraps a model with a calibration the way ``Dilated`` stretches one; its JSON is
``{"kind": "calibrated", "base": {...}, "calibration": {...}}``, which ``load_sim_profile``
reads (emulated workers refuse it: a calibration describes a serving host, not a GPU).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.simulator.jitter import quantile_grid_checked
from pdserve.steptime.dilation import Dilated
from pdserve.steptime.load import KINDS, Parser, build_fields, load_profile, parse_profile
from pdserve.steptime.model import StepTimeModel, Wrapper, has_prefill


@dataclass(frozen=True)
class HostCalibration:
    """The serving host's share of every step (see the module docstring); the defaults
    change nothing."""

    step_overhead_s: float = 0.0
    prefill_x: float = 1.0  # steps with prefill work (mixed ones included)
    decode_x: float = 1.0  # decode-only steps
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_coactive_x: float = 1.0
    decode_coactive_x: float = 1.0
    prefill_jitter: tuple[float, ...] = field(default=())
    decode_jitter: tuple[float, ...] = field(default=())
    jitter_corr: float = 0.0

    def __post_init__(self) -> None:
        if not (self.step_overhead_s >= 0 and self.prefill_s >= 0 and self.decode_s >= 0):
            raise ValueError("the per-step overhead and service constants must be >= 0")
        if not (self.prefill_x > 0 and self.decode_x > 0):
            raise ValueError("service factors must be > 0")
        if not (self.decode_coactive_x >= 1 and self.prefill_coactive_x >= 1):
            raise ValueError("co-activity factors are slowdowns: >= 1")
        for name in ("prefill_jitter", "decode_jitter"):  # JSON gives lists
            object.__setattr__(self, name, quantile_grid_checked(name, getattr(self, name)))
        if not 0 <= self.jitter_corr < 1:
            raise ValueError("jitter_corr must be in [0, 1)")

    @property
    def varies(self) -> bool:
        return bool(self.prefill_jitter or self.decode_jitter)

    def coactivity(self, prefill: bool, others_busy: bool, others_prefilling: bool) -> float:
        """How much slower a step runs on a host it shares, by what the host's other workers run
        as it starts: a step with prefill work beside any other step, a decode-only step beside
        a step with prefill work."""
        if prefill:
            return self.prefill_coactive_x if others_busy else 1.0
        return self.decode_coactive_x if others_prefilling else 1.0

    def at_speed(self, prefill: float, decode: float) -> HostCalibration:
        """This host running ``prefill`` / ``decode`` times as slow as in the calibration
        (``service_fit.host_speed``): each kind's whole in-service step scaled."""
        return dataclasses.replace(
            self,
            prefill_s=self.prefill_s * prefill,
            prefill_x=self.prefill_x * prefill,
            decode_s=self.decode_s * decode,
            decode_x=self.decode_x * decode,
        )


@dataclass(frozen=True)
class Calibrated(Wrapper):
    """``base`` as a serving worker on the calibrated host runs it; capacities unchanged."""

    base: StepTimeModel
    calibration: HostCalibration

    @property
    def name(self) -> str:
        return f"{self.base.name}+service"

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        return self.mixed_time(chunks, 0, 0)

    def mixed_time(self, chunks: Iterable[tuple[int, int]], decodes: int, decode_context: int) -> float:
        cs = list(chunks)
        engine = self.base.mixed_time(cs, decodes, decode_context)
        if not (cs or decodes) or engine <= 0:
            return 0.0
        c = self.calibration
        if has_prefill(cs):
            return c.step_overhead_s + c.prefill_s + engine * c.prefill_x
        return c.step_overhead_s + c.decode_s + engine * c.decode_x

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.step_time([(new_tokens, cached_tokens)])

    def decode_time(self, batch: int, total_context: int) -> float:
        if batch == 0:
            return 0.0
        c = self.calibration
        return c.step_overhead_s + c.decode_s + self.base.decode_time(batch, total_context) * c.decode_x

    def transfer_time(self, tokens: int) -> float:
        return self.base.transfer_time(tokens)

    def with_calibration(self, calibration: HostCalibration) -> Calibrated:
        return Calibrated(self.base, calibration)

    def to_json(self) -> str:
        base = json.loads(self.base.to_json())
        return json.dumps(
            {"kind": "calibrated", "base": base, "calibration": asdict(self.calibration)}, indent=2
        )


def calibration_of(model: StepTimeModel) -> HostCalibration:
    """The host calibration ``model`` carries (seen through time dilation: stretching every
    duration leaves ratios as they are); the neutral one if none."""
    if isinstance(model, Dilated):
        return calibration_of(model.base)
    if isinstance(model, Calibrated):
        return model.calibration
    return NEUTRAL


NEUTRAL = HostCalibration()


def _calibrated(data: dict[str, Any]) -> StepTimeModel:
    if set(data) != {"base", "calibration"}:
        raise ValueError("a calibrated profile has exactly 'base' and 'calibration'")
    if not isinstance(data["calibration"], dict):
        raise ValueError("'calibration' must be a JSON object")
    return Calibrated(parse_profile(data["base"]), build_fields(HostCalibration, data["calibration"]))


SIM_KINDS: dict[str, Parser] = {**KINDS, "calibrated": _calibrated}


def load_sim_profile(name_or_path: str) -> StepTimeModel:
    """What ``pdserve simulate`` and ``pdserve plan`` accept: any profile, calibrated or not."""
    return load_profile(name_or_path, SIM_KINDS)
