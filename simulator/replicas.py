"""Router replicas in the simulated cluster: what each replica hears from each worker (pure).

With ``routers`` > 1 every request lands on one replica, drawn at random (seeded) as a client's
connection lands on one of the processes sharing the public port, and stays with it (a move
after a lost worker, a prompt routed again: the same replica). Each replica is its own
dispatcher — its own ledger, prefix index and predictor corrections — and learns of the other
replicas' work only the way the service's replicas do: each worker keeps the real per-owner
accounting (``pdserve.worker.owners.Owners``, fed with the commands it runs and the deltas it
emits) and reports ``WorkerLoad.others`` to each replica with its load. A worker reports at the
end of every step and, when it does not step, at least every ``HEARTBEAT_S`` (read lazily: a
replica that looks at an idle worker whose last report is older hears a fresh one), so a
replica's view of the others is as old as the worker's step in flight, as in the service.

The rest of a load (running, waiting, free blocks) is read fresh, as the simulator reads it
with one router.
"""

from __future__ import annotations

import random
from dataclasses import replace

from pdserve.worker.commands import AddLocal, Command, Prefill, QueueReservation
from pdserve.worker.messages import PlacedWork, TokenDelta, WorkerLoad
from pdserve.worker.owners import Owners

HEARTBEAT_S = 0.5  # an idle worker's heartbeat (``pdserve.worker.push``)


class ReplicaDraw:
    """Which replica each request lands on: a seeded draw per request."""

    def __init__(self, routers: int, seed: int) -> None:
        if routers < 1:
            raise ValueError(f"--routers must be >= 1, got {routers}")
        self.routers = routers
        self._rng = random.Random(f"routers/{seed}")

    def __call__(self) -> int:
        return self._rng.randrange(self.routers) if self.routers > 1 else 0


class WorkerReports:
    """One worker's owners and what each replica last heard of the others' work there."""

    def __init__(self, routers: int) -> None:
        self.owners = Owners()
        self.routers = routers
        self.heard = [PlacedWork()] * routers  # ``others`` as of the last report, per replica
        self.at = 0.0  # when it last reported
        self._memo: list[tuple[WorkerLoad, PlacedWork, WorkerLoad] | None] = [None] * routers
        # a decode run's rows by owner, their tokens not delivered yet (``SimWorker``'s run)
        self.run_rows: list[int] | None = None

    # -- what the worker runs ---------------------------------------------------------------------
    def before(self, owner: int, cmd: Command) -> None:
        """``owner``'s command reaches the worker (an introducing one takes the request)."""
        if isinstance(cmd, Prefill | QueueReservation | AddLocal):
            self.owners.introduce(owner, cmd)

    def after(self, cmd: Command, answer: object) -> None:
        self.owners.command(cmd, answer)

    def failed(self, cmd: Command) -> None:
        """``cmd`` raised: an introducing command left nothing on the worker."""
        if isinstance(cmd, Prefill | QueueReservation | AddLocal):
            self.owners.forget(cmd.work.request_id)

    def on_delta(self, delta: TokenDelta) -> None:
        self.owners.on_delta(delta)

    def tokens(self, rid: str, n: int, finished: bool) -> None:
        """A request's ``n`` tokens reported without a delta (steady steps, decode runs)."""
        if finished:
            self.owners.forget(rid)
        else:
            self.owners.tokens(rid, n)

    def start_run(self, rids: list[str]) -> None:
        rows = [0] * self.routers
        for rid in rids:
            owner = self.owners.owner_of(rid)
            if owner is not None:
                rows[owner] += 1
        self.run_rows = rows

    # -- reports ---------------------------------------------------------------------------------
    def report(self, now: float, undelivered: int = 0) -> None:
        """The worker reports now: every replica hears the others' work (a decode run's
        ``undelivered`` steps' tokens included). This is where each replica hears a worker:
        the one place a replica's view of it is fed (its KV events would arrive here too)."""
        self.at = now
        owners = self.owners
        rows = self.run_rows if undelivered else None
        total = sum(rows) if rows is not None else 0
        heard = []
        for r in range(self.routers):
            seen = owners.others(r)
            if rows is not None:
                left = seen.decode_remaining - undelivered * (total - rows[r])
                seen = replace(seen, decode_remaining=max(0, left))
            heard.append(seen)
        self.heard = heard

    def load_for(self, replica: int, load: WorkerLoad, now: float, stepping: bool) -> WorkerLoad:
        """``load`` as ``replica`` has it: with the others' work it last heard of."""
        if not stepping and now - self.at >= HEARTBEAT_S:
            self.report(now)  # an idle worker's heartbeat came in the meantime
        seen = self.heard[replica]
        memo = self._memo[replica]
        if memo is not None and memo[0] is load and memo[1] is seen:
            return memo[2]
        out = replace(load, others=seen)
        self._memo[replica] = (load, seen, out)
        return out
