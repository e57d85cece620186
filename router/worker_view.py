"""A worker as one router replica sees it: the work its own ledger placed there, plus the work
the other replicas placed, which the worker reports with its load (``WorkerLoad.others``)
(pure Python).

The ledger is exact for what this replica placed and knows each of those requests' TPOT
target; the other replicas' work arrives only as sums, as of the worker's last report (at most
a step old). So foreign work counts wherever the policy prices time — a prefill queue's wait,
the decode batch's size and context (its step time), the requests that step slows down, the
share of a decode worker's time that goes to local prefills — but not where a target is
needed: this replica does not know the foreign requests' TPOT targets, so none of them is
counted as one the step would make miss its target. Only where the policy weighs how close a
worker runs to the targets on it (its risk) are foreign requests taken to carry the target of
the request being placed: in a deployment of one SLO class that is exact, and without it a
replica would rank a worker busy with another replica's requests as if nobody there had a
target, and pile onto it.

Foreign prompts are priced as that many prompts of their mean length (the worker sends only
their count and token sum); foreign decodes' expected tokens to come are half of the most they
may still generate, as the ledger expects of its own (``DecodeEntry.remaining``). With nothing
foreign (one router), every number here is the ledger's own, to the bit.
"""

from __future__ import annotations

import math

from pdserve.router.ledger import DecodeBatch, PrefillQueue
from pdserve.worker.messages import PlacedWork


class PrefillView:
    """A prefill queue: this replica's jobs, then the foreign prompts (``foreign_s`` of
    predicted compute, not started as far as this replica knows)."""

    __slots__ = ("foreign_s", "queue", "tokens")

    def __init__(self, queue: PrefillQueue, others: PlacedWork, foreign_s: float) -> None:
        self.queue = queue
        self.tokens = queue.tokens + others.prefill_tokens  # prompt tokens still to prefill
        self.foreign_s = foreign_s

    def wait_s(self, now: float) -> float:
        """Predicted time before a prefill added now would start."""
        return self.queue.wait_s(now) + self.foreign_s

    def elapsed_s(self, now: float) -> float:
        """How long the queue's head has run (foreign prompts' progress is not reported)."""
        return now - self.queue.busy_since if self.queue.jobs else 0.0


class DecodeView:
    """A decode worker's batch: this replica's entries and the foreign ones, summed."""

    __slots__ = ("batch", "context", "foreign", "foreign_prefill_s", "remaining", "size")

    def __init__(self, batch: DecodeBatch, others: PlacedWork) -> None:
        self.batch = batch
        self.foreign = others.decodes
        self.size = batch.size + others.decodes
        self.context = batch.context + others.decode_context
        self.remaining = batch.remaining + others.decode_remaining // 2
        self.foreign_prefill_s = 0.0  # foreign local prefills queued on it: their time in its steps

    def mean_remaining(self) -> float:
        return self.remaining / self.size if self.size else 0.0

    def prefill_share(self, now: float, window_s: float) -> float:
        """Fraction of the last ``window_s`` it spent on local prefills (the batch's record holds
        this replica's and the foreign ones it saw arrive)."""
        return self.batch.prefill_share(now, window_s)

    def tightest_slo(self, assumed: float = math.inf) -> float:
        """The tightest TPOT target on it: of this replica's requests, and ``assumed`` for the
        foreign ones (whose targets this replica does not know), if any."""
        own = self.batch.tightest_slo()
        return min(own, assumed) if self.foreign else own

    def misses_between(self, before_s: float, after_s: float) -> int:
        """This replica's requests whose target lies in ``[before_s, after_s)``."""
        return self.batch.misses_between(before_s, after_s)


def mean_prompt(others: PlacedWork) -> int:
    """The foreign prompts' mean length (0: none)."""
    return -(-others.prefill_tokens // others.prefills) if others.prefills else 0
