"""A run of decode-only steps of one simulated worker, its state applied only when looked at.

Between the events that touch a worker from outside (an arrival routed to it, a command, a
transfer landing, a reservation's answer) a decode worker's steps are fixed in advance: every
running request gets one token a step until the first of them ends or a block it needs is not
free. At the rate a long-prompt workload is served that is tens to hundreds of steps, and even
a steady step (``pdserve.simulator.fast_step``) costs some work for each running request.

A ``DecodeRun`` keeps such a stretch pending: each step is still an event on the clock (pushed
when the step starts, at its end time, as the engine's step would be — so every other event
keeps its place in the order), but a step's event only computes the next step's duration. The
steps' effects on the engine (each request's tokens and computed count, the blocks it grows
into and publishes) are applied when someone looks, in the order the steps made them, and the
tokens are handed to the router the same way: ``apply`` brings the engine to the state after
the steps started so far, ``deliver`` reports the tokens of the steps ended so far. A run ends
at its planned length (before a step that ends a request, or needs a block the pool lacks) or
when something outside changes the worker (``SimWorker`` applies it first, then lets the step in
flight end as a steady step). Whole runs equal the engines' runs, metric for metric (tests).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.model_runtime.request import Request
from pdserve.simulator.sim_request import SimRequest
from pdserve.simulator.virtual import TOKEN
from pdserve.steptime.model import StepTimeModel
from pdserve.steptime.roofline import RooflineProfile

MIN_STEPS = 4  # shorter stretches are left to single steady steps


class DecodeRun:
    def __init__(self, engine: DecodeEngine, rows: list[Request], steps: int, profile: StepTimeModel) -> None:
        self.engine = engine
        self.rows = rows
        self.limit = steps  # steps planned
        self.profile = profile
        self.closed = type(profile) is RooflineProfile  # its decode step time in closed form
        self.computed0 = [r.num_computed_tokens for r in rows]
        self.outputs0 = [len(r.output_token_ids) for r in rows]
        self.context0 = sum(self.computed0)
        self.started = 0  # steps whose start has passed (their state changes made, in the engine's view)
        self.ended = 0  # steps whose end has passed (their tokens out)
        self.applied = 0  # steps whose state changes are applied to the engine
        self.delivered = 0  # steps whose tokens the router has
        self.ends: list[float] = []  # each started step's end time
        self.cut = False  # something outside changed the worker: the step in flight is the last
        self.grow_steps: list[int] = []  # the steps that take a block, one entry a block, in order

    @staticmethod
    def plan(engine: DecodeEngine, profile: StepTimeModel) -> DecodeRun | None:
        """A run from the engine's state now, if at least ``MIN_STEPS`` decode-only steps lie
        ahead of it with nothing but their own tokens changing (see the module docstring)."""
        if engine.overlap or engine._launched is not None or engine._pending:
            return None
        sched = engine.scheduler
        if sched.prefill.num_waiting or sched.prefill.num_running:
            return None
        rows = list(sched.decode.running)
        if not rows or len(rows) > sched.config.max_num_seqs:
            return None
        steps = None
        for req in rows:
            p = req.params
            if TOKEN in p.stop_token_ids or (not p.ignore_eos and TOKEN in req.eos_token_ids):
                return None  # any token might end it
            # the step giving its last token ends it: a run stops before
            left = p.max_tokens - len(req.output_token_ids) - 1
            steps = left if steps is None else min(steps, left)
        assert steps is not None
        kv = engine.kv
        bs = kv.block_size
        free = kv.num_free_blocks
        # the step that needs a block more than the pool has preempts: a run stops before it
        grows: list[int] = []
        for req in rows:
            first = len(kv.block_table(req.request_id)) * bs - req.num_computed_tokens + 1
            grows.extend(range(first, steps + 1, bs))
        grows.sort()
        if len(grows) > free:
            steps = grows[free] - 1
        if steps < MIN_STEPS:
            return None
        run = DecodeRun(engine, rows, steps, profile)
        run.grow_steps = grows
        return run

    def pending_grows(self) -> int:
        """Blocks the steps started so far have taken that ``apply`` has not taken yet."""
        return bisect.bisect_right(self.grow_steps, self.started) - bisect.bisect_right(
            self.grow_steps, self.applied
        )

    def duration(self, step: int) -> float:
        """Step ``step``'s time (1-based), as the worker prices the step's chunks."""
        n = len(self.rows)
        context = self.context0 + (step - 1) * n  # the rows' start positions, summed
        if self.closed:
            # RooflineProfile.step_time of n decode chunks whose starts sum to ``context`` is this
            # to the last bit: its token and context counts are integer sums either way
            return self.profile.mixed_time((), n, context)
        return self.profile.step_time([(1, c + step - 1) for c in self.computed0])

    def apply(self, upto: int) -> None:
        """Apply steps ``applied + 1 .. upto`` to the engine: each row's blocks grown into and
        published, in the order the steps made them (step by step; in a step, every row's new
        block before any publication, rows in order), then each row's tokens and counts."""
        first = self.applied + 1
        if upto < first:
            return
        kv = self.engine.kv
        bs = kv.block_size
        events: list[tuple[int, int, int]] = []  # (step, 0 grow | 1 publish, row)
        for i, req in enumerate(self.rows):
            c0 = self.computed0[i]
            # step j computes position c0 + j - 1: it grows into a block when c0 + j passes
            # the table, and publishes one when c0 + j fills it
            grow = len(kv.block_table(req.request_id)) * bs - (c0 + first - 1) + first
            for j in range(grow, upto + 1, bs):
                events.append((j, 0, i))
            fill = first + (-(c0 + first)) % bs
            for j in range(fill, upto + 1, bs):
                events.append((j, 1, i))
        events.sort()
        for j, kind, i in events:
            req = self.rows[i]
            self._bring(i, j - 1 + kind)
            if kind == 0:
                ok = kv.allocate_slots(req, 1)
                assert ok, "counted the free blocks when the run was planned"
            else:
                kv.cache_computed_blocks(req)
        emitted = self.engine._emitted
        for i, req in enumerate(self.rows):
            self._bring(i, upto)
            emitted[req.request_id] = len(req.output_token_ids)
        self.applied = upto

    def _bring(self, i: int, steps: int) -> None:
        """Row ``i`` as it is after ``steps`` steps of the run."""
        req = self.rows[i]
        req.num_computed_tokens = self.computed0[i] + steps
        more = self.outputs0[i] + steps - len(req.output_token_ids)
        if more > 0:
            req.output_token_ids.extend([TOKEN] * more)

    def deliver(self, requests: Callable[[str], SimRequest | None], upto: int) -> None:
        """Hand the router the tokens of steps ``delivered + 1 .. upto`` (each left at its
        step's end): what ``Cluster.on_tokens`` does with each row's one-token deltas."""
        if upto <= self.delivered:
            return
        times = self.ends[self.delivered : upto]
        for req in self.rows:
            sr = requests(req.request_id)
            if sr is not None:
                sr.token_times.extend(times)
        self.delivered = upto
