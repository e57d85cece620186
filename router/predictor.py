"""Per-worker latency predictions, corrected online from what the router observes (pure Python).

``StepPredictor`` starts from a step-time model (``pdserve.steptime``: the roofline built-ins, a
``pdserve profile`` fit, or any object with the same methods) and scales it by one correction
factor per (worker, phase) and per inbound link. Each observation moves the factor
toward ``observed / predicted`` with exponential decay — the ratio correction Dynamo's planner
applies to its TTFT/ITL profiles — so a worker that runs slower than its profile (another
tenant, a throttled GPU, a CPU run of a GPU profile) is predicted slower within a few requests,
and an old observation fades.

What the router can observe, and which factor it corrects:

- prefill: a request's TTFT against the TTFT predicted when it was routed (queue + compute);
- decode: the median gap between a request's tokens against the step time predicted for the
  batch it joined (the median ignores the KV hand-off gap and prefill stalls);
- transfer: the mean time of the KV transfers a decode worker received since its last report
  (its transport's counters) against the profile's link time for that many bytes. The
  hand-off gap seen at the router is not used: it also holds decode's scheduling.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.steptime.model import StepTimeModel


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    TRANSFER = "transfer"


@dataclass
class Correction:
    factor: float = 1.0
    samples: int = 0

    def update(self, observed: float, predicted: float, decay: float, lo: float, hi: float) -> None:
        if not (predicted > 0 and observed > 0 and math.isfinite(observed)):
            return
        ratio = min(hi, max(lo, observed / predicted))
        # The first sample replaces the prior outright: a profile can be off by orders of
        # magnitude (a GPU profile on a CPU), and decaying toward that would take dozens of requests.
        self.factor = ratio if self.samples == 0 else (1 - decay) * self.factor + decay * ratio
        self.samples += 1


class StepPredictor:
    """Per-worker step, prefill, decode and transfer times, corrected online."""

    def __init__(
        self,
        profile: StepTimeModel,
        decay: float = 0.2,
        bounds: tuple[float, float] = (1e-3, 1e4),
        prefill_profile: StepTimeModel | None = None,
    ) -> None:
        if not 0 < decay <= 1:
            raise ValueError("decay must be in (0, 1]")
        self.profile = profile
        # the prefill pool's workers where they run at another tensor-parallel degree
        self.prefill_profile = prefill_profile or profile
        self.decay = decay
        self.bounds = bounds
        self._corr: dict[tuple[str, Phase], Correction] = {}
        self._prior: dict[Phase, tuple[int, float]] = {p: (0, 0.0) for p in Phase}  # (keys, factor sum)

    # -- predictions (seconds) ---------------------------------------------------------------
    def factor(self, key: str, phase: Phase) -> float:
        """``key``'s factor; for a worker or link not observed yet, the mean of its phase's
        observed factors (its peers run the same hardware and model), else 1."""
        c = self._corr.get((key, phase))
        if c is not None:
            return c.factor
        n, total = self._prior[phase]
        return total / n if n else 1.0

    def step_s(self, worker: str, chunks: Iterable[tuple[int, int]], phase: Phase = Phase.DECODE) -> float:
        """One forward pass on ``worker`` over ``(new tokens, cached tokens)`` chunks."""
        return self.profile.step_time(chunks) * self.factor(worker, phase)

    def mixed_s(
        self,
        worker: str,
        chunks: Iterable[tuple[int, int]],
        decodes: int,
        decode_context: int,
        phase: Phase = Phase.PREFILL,
    ) -> float:
        """A pass over ``chunks`` beside ``decodes`` decode tokens whose contexts sum to
        ``decode_context`` (the profile's ``mixed_time``), on ``worker``."""
        return self.profile.mixed_time(chunks, decodes, decode_context) * self.factor(worker, phase)

    def prefill_s(self, worker: str, new_tokens: int, cached_tokens: int = 0) -> float:
        """A prompt on prefill worker ``worker``."""
        chunks = [(max(1, new_tokens), cached_tokens)]
        return self.prefill_profile.step_time(chunks) * self.factor(worker, Phase.PREFILL)

    def decode_step_s(self, worker: str, batch: int, total_context: int) -> float:
        if batch <= 0:
            return 0.0
        return self.profile.decode_time(batch, max(batch, total_context)) * self.factor(worker, Phase.DECODE)

    def transfer_s(self, dst: str, tokens: int, corrected: bool = True) -> float:
        """KV of ``tokens`` into ``dst``: the profile's link scaled by what ``dst`` measured
        arriving (its transfer counters)."""
        base = self.profile.transfer_time(tokens)
        return base * self.factor(inbound(dst), Phase.TRANSFER) if corrected else base

    # -- observations ------------------------------------------------------------------------
    def observe(self, key: str, phase: Phase, observed_s: float, predicted_s: float) -> None:
        """Fold one observation into ``key``'s factor (``key``: a worker id, or ``inbound(dst)``).
        ``predicted_s`` is the profile's, uncorrected: the factor moves toward observed / that."""
        corr = self._corr.get((key, phase))
        if corr is None:
            corr = self._corr[(key, phase)] = Correction(self.factor(key, phase))
        n, total = self._prior[phase]
        old = corr.factor if corr.samples else 0.0
        corr.update(observed_s, predicted_s, self.decay, *self.bounds)
        if corr.samples:
            self._prior[phase] = (n + (old == 0.0), total - old + corr.factor)

    def forget(self, worker: str) -> None:
        """Drop what was learned about ``worker``, its inbound link included."""
        for key in [k for k in self._corr if k[0] in (worker, inbound(worker))]:
            c = self._corr.pop(key)
            if c.samples:
                n, total = self._prior[key[1]]
                self._prior[key[1]] = (n - 1, total - c.factor)

    def corrections(self) -> list[tuple[str, Phase, float]]:
        return [(k, phase, c.factor) for (k, phase), c in sorted(self._corr.items(), key=lambda i: i[0][0])]


def inbound(dst: str) -> str:
    """The correction key of transfers into ``dst`` (what its receive counters measure)."""
    return f"->{dst}"
