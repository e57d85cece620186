"""The router's own account of the work it has placed on each worker (pure Python).

Worker load reports arrive only with output batches, so between two reports the router would
not see the requests it just sent. The ledger is exact for what this router sent: each prefill
(on a prefill worker, or locally on a decode worker) until its first token, and each request on
a decode worker from routing until it ends. The goodput policy predicts from it; the router
and the simulator drive it through the same calls::

    add_prefill / add_decode  (routed)
    prefill_done              (first token seen)
    decode_done               (request ended: finished, failed or aborted)
    drop_worker               (the worker died: forget everything on it)
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

NO_TARGET = math.inf


class PrefillQueue:
    """Prefills waiting or running on one worker, served first come first served."""

    def __init__(self) -> None:
        self.jobs: OrderedDict[str, tuple[float, int]] = OrderedDict()  # id -> (predicted s, tokens)
        self.busy_since = 0.0  # when the job now at the head started (predicted)
        self.total_s = 0.0
        self.tokens = 0  # prompt tokens still to prefill

    def add(self, rid: str, seconds: float, now: float, tokens: int = 0) -> None:
        if not self.jobs:
            self.busy_since = now
        self.jobs[rid] = (seconds, tokens)
        self.total_s += seconds
        self.tokens += tokens

    def _pop(self, rid: str) -> bool:
        job = self.jobs.pop(rid, None)
        if job is None:
            return False
        self.total_s = max(0.0, self.total_s - job[0]) if self.jobs else 0.0
        self.tokens = max(0, self.tokens - job[1]) if self.jobs else 0
        return True

    def done(self, rid: str, now: float) -> None:
        if self._pop(rid):
            self.busy_since = now

    def discard(self, rid: str) -> None:
        """Forget a job that will never run (its request ended elsewhere)."""
        self._pop(rid)

    def wait_s(self, now: float) -> float:
        """Predicted time before a prefill added now would start."""
        if not self.jobs:
            return 0.0
        return max(0.0, self.total_s - (now - self.busy_since))

    def __len__(self) -> int:
        return len(self.jobs)


@dataclass
class DecodeEntry:
    context: int  # expected mean context while decoding: prompt + half the output
    remaining: int  # expected tokens still to generate
    tpot_slo_s: float  # math.inf without a TPOT target


@dataclass
class DecodeBatch:
    """Requests placed on one decode worker, with their TPOT targets kept sorted so the policy
    can count, in O(log n), how many would miss their target at a given step time."""

    entries: dict[str, DecodeEntry] = field(default_factory=dict)
    context: int = 0
    remaining: int = 0
    _slos: list[float] = field(default_factory=list)
    _local: deque[tuple[float, float]] = field(default_factory=deque)  # (when, step seconds added)
    _local_sum: float = 0.0

    def add_local_prefill(self, now: float, extra_s: float) -> None:
        """A prefill placed on this decode worker adds ``extra_s`` to its steps."""
        self._local.append((now, extra_s))
        self._local_sum += extra_s

    def prefill_share(self, now: float, window_s: float) -> float:
        """Fraction of the last ``window_s`` this worker spends on local prefills (its steps'
        share that produces no decode token)."""
        while self._local and self._local[0][0] <= now - window_s:
            self._local_sum -= self._local.popleft()[1]
        if not self._local:
            self._local_sum = 0.0
        return max(0.0, self._local_sum) / window_s

    def tightest_slo(self) -> float:
        return self._slos[0] if self._slos else NO_TARGET

    def add(self, rid: str, entry: DecodeEntry) -> None:
        self.entries[rid] = entry
        self.context += entry.context
        self.remaining += entry.remaining
        bisect.insort(self._slos, entry.tpot_slo_s)

    def remove(self, rid: str) -> None:
        e = self.entries.pop(rid, None)
        if e is None:
            return
        self.context -= e.context
        self.remaining -= e.remaining
        i = bisect.bisect_left(self._slos, e.tpot_slo_s)
        del self._slos[i]

    @property
    def size(self) -> int:
        return len(self.entries)

    def mean_remaining(self) -> float:
        return self.remaining / len(self.entries) if self.entries else 0.0

    def misses_between(self, before_s: float, after_s: float) -> int:
        """Requests whose target lies in ``[before_s, after_s)``: met at ``before_s``, missed at
        ``after_s`` (the step time going from one to the other)."""
        if after_s <= before_s:
            return 0
        return bisect.bisect_left(self._slos, after_s) - bisect.bisect_left(self._slos, before_s)


class Ledger:
    def __init__(self) -> None:
        self.prefills: dict[str, PrefillQueue] = {}
        self.decodes: dict[str, DecodeBatch] = {}
        self._where: dict[str, tuple[str | None, str]] = {}  # rid -> (prefill worker, decode worker)

    def prefill_queue(self, worker: str) -> PrefillQueue:
        return self.prefills.setdefault(worker, PrefillQueue())

    def batch(self, worker: str) -> DecodeBatch:
        return self.decodes.setdefault(worker, DecodeBatch())

    def add(
        self,
        rid: str,
        prefill_worker: str,
        prefill_s: float,
        decode_worker: str,
        entry: DecodeEntry,
        now: float,
        prefill_tokens: int = 0,
    ) -> None:
        """Place ``rid``: its prefill on ``prefill_worker`` (which may be the decode worker)."""
        self.prefill_queue(prefill_worker).add(rid, prefill_s, now, prefill_tokens)
        self.batch(decode_worker).add(rid, entry)
        self._where[rid] = (prefill_worker, decode_worker)

    def prefill_done(self, rid: str, now: float) -> None:
        where = self._where.get(rid)
        if where is not None and where[0] is not None:
            self.prefill_queue(where[0]).done(rid, now)
            self._where[rid] = (None, where[1])

    def decode_done(self, rid: str, now: float) -> None:
        where = self._where.pop(rid, None)
        if where is None:
            return
        if where[0] is not None:
            self.prefill_queue(where[0]).done(rid, now)
        self.batch(where[1]).remove(rid)

    def drop_worker(self, worker: str) -> None:
        self.prefills.pop(worker, None)
        self.decodes.pop(worker, None)
        for rid, (p, d) in list(self._where.items()):
            if d == worker:
                del self._where[rid]
                if p is not None and p in self.prefills:
                    self.prefills[p].discard(rid)
            elif p == worker:
                self._where[rid] = (None, d)

    def __contains__(self, rid: str) -> bool:
        return rid in self._where

    def __len__(self) -> int:
        return len(self._where)
