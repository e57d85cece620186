"""What the request-level model (``pdserve.planning.fluid``) takes and gives: its settings,
arrivals in time order (and the ticks that deal them out), the pools by role, and the requests
that ended in a tick."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from pdserve.model_runtime.backend import GPU_MAX_SEQS, GPU_STEP_TOKENS


@dataclass(frozen=True)
class FluidConfig:
    ttft_s: float = 0.0  # targets (0: none); a good request meets both
    tpot_s: float = 0.0
    reject: bool = False  # refuse a request predicted to miss (admission ``reject``)
    step_tokens: int = GPU_STEP_TOKENS  # a prefill step's prompt tokens
    max_seqs: int = GPU_MAX_SEQS  # a decode worker's batch
    reserve_timeout_s: float = 30.0
    tick_s: float = 0.5

    def __post_init__(self) -> None:
        if not (self.ttft_s >= 0 and self.tpot_s >= 0 and self.reserve_timeout_s > 0):
            raise ValueError("targets must be >= 0 and the reservation deadline > 0")
        if not (0 < self.tick_s <= 10) or self.step_tokens < 1 or self.max_seqs < 1:
            raise ValueError("tick must be in (0, 10] s, step tokens and batch >= 1")

    def good(self, ttft: float, tpot: float) -> bool:
        """Whether a served request's TTFT and TPOT meet the targets."""
        return (not self.ttft_s or ttft <= self.ttft_s) and (not self.tpot_s or tpot <= self.tpot_s)


@dataclass(frozen=True)
class Arrivals:
    """Requests in arrival order: times (s), prompt and output lengths (tokens)."""

    t: np.ndarray
    prompt: np.ndarray
    output: np.ndarray


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Ended:
    """Requests that ended in a tick: end time, TTFT and TPOT (NaN when not served), good, and
    when each arrived."""

    end: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    good: np.ndarray
    arrival: np.ndarray


def ticks(arrivals: Iterable[Arrivals], tick_s: float) -> Iterator[tuple[float, Arrivals, bool]]:
    """``(tick end, the arrivals before it, whether more are to come)`` from chunks of arrivals
    in time order, one tick at a time; empty ticks go on once they run out (the caller stops)."""
    chunks = iter(arrivals)
    buf = Arrivals(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    more = True
    for k in itertools.count(1):
        end = k * tick_s
        while more and (not len(buf.t) or buf.t[-1] < end):
            nxt = next(chunks, None)
            if nxt is None:
                more = False
                break
            buf = Arrivals(
                *(
                    np.concatenate((a, b))
                    for a, b in ((buf.t, nxt.t), (buf.prompt, nxt.prompt), (buf.output, nxt.output))
                )
            )
        i = int(np.searchsorted(buf.t, end, side="left"))
        yield end, Arrivals(buf.t[:i], buf.prompt[:i], buf.output[:i]), more or i < len(buf.t)
        buf = Arrivals(buf.t[i:], buf.prompt[i:], buf.output[i:])
