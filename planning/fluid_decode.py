"""The requests decoding in the request-level model (``pdserve.planning.fluid``), on every
decode worker at once: one row a request in parallel arrays, advanced a tick at a time.

A worker's step over a tick is ``decode_time`` of the batch it runs then, each request counted
for the share of the tick it runs (joining late, or finishing early); each advances
``tick / step`` tokens, its context growing as it does, and one that runs out of tokens ends
inside the tick, at the time interpolated on its step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.planning.fluid_data import Ended, FluidConfig
from pdserve.planning.fluid_records import FluidRequest
from pdserve.steptime.model import StepTimeModel

_COLUMNS = ("w", "left", "ctx", "first", "arrival", "output", "since", "kv")


@dataclass(frozen=True)
class Finished:
    """The requests a tick ended: what they met, and the workers and KV tokens they free."""

    ended: Ended
    worker: np.ndarray
    kv: np.ndarray


class RunningDecode:
    """Rows: worker index, tokens left, context, first token, arrival, output, the time they are
    advanced to, KV tokens reserved. The caller owns the workers' accounts: it frees what
    ``advance`` reports finished."""

    def __init__(self, model: StepTimeModel, config: FluidConfig) -> None:
        self.model = model
        self.config = config
        self.rows = {k: np.zeros(0, dtype=np.int64 if k == "w" else np.float64) for k in _COLUMNS}

    def __len__(self) -> int:
        return len(self.rows["w"])

    def counts(self, n: int) -> np.ndarray:
        """Requests running on each of ``n`` workers."""
        out: np.ndarray = np.bincount(self.rows["w"], minlength=n)
        return out

    def contexts(self, n: int) -> np.ndarray:
        """Σ context of the requests running on each of ``n`` workers."""
        out: np.ndarray = np.bincount(self.rows["w"], weights=self.rows["ctx"], minlength=n)
        return out

    def add(self, joined: list[FluidRequest], joined_at: list[float]) -> None:
        """``joined[i]`` starts decoding (its first token already out) at ``joined_at[i]``."""
        if not joined:
            return
        new = {
            "w": np.array([r.decode.index for r in joined], dtype=np.int64),
            "left": np.array([r.output - 1 for r in joined], dtype=np.float64),
            "ctx": np.array([r.prompt + 1 for r in joined], dtype=np.float64),
            "first": np.array([r.first for r in joined]),
            "arrival": np.array([r.arrival for r in joined]),
            "output": np.array([r.output for r in joined], dtype=np.float64),
            "since": np.array(joined_at),
            "kv": np.array([r.kv for r in joined], dtype=np.float64),
        }
        for k in self.rows:
            self.rows[k] = np.concatenate((self.rows[k], new[k]))

    def advance(self, t0: float, t1: float, n: int) -> Finished | None:
        """Every row from ``t0`` (or its join) to ``t1``, over ``n`` workers; the rows that end
        are removed and returned."""
        run = self.rows
        if not len(run["w"]):
            return None
        # A worker's step is that of the batch it runs over the tick: each request counted for
        # the share of the tick it runs (joining late, or finishing early: a second pass, once
        # the first has said who finishes when).
        begin = np.maximum(run["since"], t0)
        present = (t1 - begin) / (t1 - t0)
        s = self._steps(present, n)
        done = (t1 - begin) / s >= run["left"]
        if done.any():
            present = np.where(done, np.minimum(present, run["left"] * s / (t1 - t0)), present)
            s = self._steps(present, n)
        progress = (t1 - begin) / s
        done = progress >= run["left"]
        finished = None
        if done.any():
            fin = begin[done] + run["left"][done] * s[done]
            first, out = run["first"][done], run["output"][done]
            ttft = first - run["arrival"][done]
            tpot = (fin - first) / np.maximum(1.0, out - 1)
            c = self.config
            good = np.ones(len(fin), dtype=bool)
            if c.ttft_s:
                good &= ttft <= c.ttft_s
            if c.tpot_s:
                good &= tpot <= c.tpot_s
            ended = Ended(fin, ttft, tpot, good, run["arrival"][done])
            finished = Finished(ended, run["w"][done], run["kv"][done])
            keep = ~done
            for k in run:
                run[k] = run[k][keep]
            progress, begin = progress[keep], begin[keep]
        run["left"] -= progress
        run["ctx"] += progress
        run["since"] = np.full(len(run["w"]), t1)
        return finished

    def _steps(self, present: np.ndarray, n: int) -> np.ndarray:
        """Each row's step time: its worker's, for the batch weighted by ``present``."""
        w = self.rows["w"]
        batch = np.bincount(w, weights=present, minlength=n)
        context = np.bincount(w, weights=present * self.rows["ctx"], minlength=n)
        step = np.ones(n)
        for i in np.flatnonzero(batch):
            b = max(1, round(batch[i]))
            step[i] = self.model.decode_time(b, max(b, round(context[i])))
        out: np.ndarray = step[w]
        return out
