"""One attempt of a request, as a pure state machine: events in, typed effects out.

An ``Attempt`` is one dispatch of a request under one internal id. Its driver — the asyncio
router (``pdserve.router.request_flow``) with real messages and time, or the simulator
(``pdserve.simulator.cluster``) with its event clock — tells it what happened (a command was
answered or failed, a worker sent a delta, a worker was lost, the request ended) and carries
out what it answers: typed commands to workers (``Send``), which workers hold the attempt
(``Hold`` / ``Drop``), tokens for the client (``Deliver``), a failure (``Fail``) or a move to
another worker (``Relocate``). It does no I/O and keeps no clock.

A remotely prefilled attempt runs two tracks at once, joined where both are needed::

    DISPATCHED ── Prefill ─────────▶ prefill answered ──┐
        │                                               ├─▶ TARGET_SET ─ (KV moves) ─┐
        └── QueueReservation ─▶ AwaitReservation ─▶ RESERVED ─┐                       │
                 │ refused / expired: FAILED (RESOURCE_EXHAUSTED)  ├─▶ HANDED_OFF ─▶ DECODING ─▶ ENDED
                                          FIRST_TOKEN (prefill) ───┘   (Start)

A locally prefilled one sends ``AddLocal`` and goes DISPATCHED ─▶ DECODING ─▶ ENDED. From any
stage: a lost worker, or a command answered "worker gone", before the first token is out ends
the attempt with ``Relocate`` (the driver moves the request, under a new id, or fails it); a
transfer lost after the first token (prefill's ``kv_lost`` delta, prefill lost, or its
``SetTarget`` unanswered) sends decode ``KvLost`` once its blocks are reserved, so decode
recomputes the prompt; a request fault fails it (``Fail``). ``end`` closes it from any stage
(finished, aborted, failed or moved): every worker still holding it gets ``Abort``.

Contract: the driver feeds every answer or failure of a ``Send`` back to the attempt that
emitted it, in any order; commands for one worker go out in the order emitted. Once ``end``
ran, the attempt ignores every event and emits nothing: a late answer of a replaced attempt
cannot touch its successor. A ``Send`` marked ``quiet`` (``Abort``, ``KvLost``) has no outcome
the request depends on. The driver skips ``Send``s to workers it knows are gone.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.router.errors import Code
from pdserve.worker.commands import (
    Abort,
    AddLocal,
    AwaitReservation,
    Command,
    KvLost,
    Prefill,
    QueueReservation,
    SetTarget,
    Start,
)
from pdserve.worker.messages import KVTarget, TokenDelta, WorkItem


class Stage(enum.IntEnum):
    """How far the attempt got (it only moves forward)."""

    DISPATCHED = 0  # commands out, nothing settled
    RESERVED = 1  # decode holds blocks for the prompt's KV
    TARGET_SET = 2  # prefill knows where the KV goes
    FIRST_TOKEN = 3  # prefill's first token is out
    HANDED_OFF = 4  # decode was told to start (``Start``)
    DECODING = 5  # the decode worker's tokens arrive
    FAILED = 6  # a failure or a move was decided: only ``end`` is left
    ENDED = 7


class Failure(enum.Enum):
    """How a command failed, as the driver saw it."""

    LOST = "lost"  # the worker is gone (or its channel ended before the answer)
    TIMEOUT = "timeout"  # no answer in time
    INVALID = "invalid"  # the request's fault: a field out of range (``field`` names it)
    VALUE = "value"  # the request's fault: it cannot be served there
    INTERNAL = "internal"  # anything else


def failure_of(e: Exception) -> tuple[Failure, str, str | None]:
    """How the error a command raised reads to an attempt: (failure, message, field). A lost
    worker is the driver's own to recognise (its transport's error type)."""
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):  # (two classes before Python 3.11)
        return Failure.TIMEOUT, "no answer in time", None
    if isinstance(e, InvalidRequestError):
        return Failure.INVALID, str(e), e.field
    if isinstance(e, ValueError):
        return Failure.VALUE, str(e), None
    return Failure.INTERNAL, type(e).__name__, None


@dataclass(frozen=True)
class Timeouts:
    call_s: float  # any command's answer
    reserve_s: float  # how long decode may wait for room for the prompt's KV


# -- effects ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    worker: str
    command: Command
    timeout_s: float
    quiet: bool = False  # its outcome does not matter to the request


@dataclass(frozen=True)
class Hold:
    """``worker`` holds the attempt (it gets ``Abort`` when the attempt ends)."""

    worker: str


@dataclass(frozen=True)
class Drop:
    """``worker`` no longer holds the attempt."""

    worker: str


@dataclass(frozen=True)
class Deliver:
    """A delta for the client (tokens, the end)."""

    worker: str
    delta: TokenDelta


@dataclass(frozen=True)
class Fail:
    code: Code
    message: str
    field: str | None = None


@dataclass(frozen=True)
class Relocate:
    """A worker was lost before the request could go on without it: move the request, or fail
    it with ``why`` and the reason it cannot move."""

    why: str


@dataclass(frozen=True)
class TakenIn:
    """The worker that prefills the prompt holds it (the router's queueing is over)."""


@dataclass(frozen=True)
class Reserved:
    """Decode holds blocks for the prompt's KV."""


Effect = Send | Hold | Drop | Deliver | Fail | Relocate | TakenIn | Reserved


class Attempt:
    def __init__(
        self, work: WorkItem, decode: str, prefill: str | None, timeouts: Timeouts, source_ranks: int = 1
    ) -> None:
        """``source_ranks``: the prefill worker's KV ranks (decode expects a part from each)."""
        self.work = work
        self.source_ranks = source_ranks
        self.request_id = work.request_id
        self.decode = decode
        self.prefill = prefill  # None: decode prefills it itself
        self.transfer_id = f"kv-{work.request_id}" if prefill is not None else ""
        self.timeouts = timeouts
        self.stage = Stage.DISPATCHED
        self.holders: dict[str, None] = {}  # in the order they took it
        self.target: KVTarget | None = None
        self.prefill_taken = False  # prefill answered ``Prefill``
        self.first: tuple[int, int] | None = None  # (first token, cached prompt tokens)
        self.target_sent = self.start_sent = False
        self.kv_lost = self.kv_lost_sent = False  # decode must recompute the prompt

    @property
    def over(self) -> bool:
        """Failed, moved or ended: nothing but ``end`` changes it."""
        return self.stage >= Stage.FAILED

    def _reach(self, stage: Stage) -> None:
        if stage > self.stage:
            self.stage = stage

    # -- events ----------------------------------------------------------------------------------
    def dispatch(self) -> list[Effect]:
        """The attempt's first commands. Prefill's goes first: it is on the TTFT path, the
        reservation is not."""
        t, work = self.timeouts, self.work
        if self.prefill is None:
            return [self._hold(self.decode), Send(self.decode, AddLocal(work), t.call_s)]
        return [
            self._hold(self.decode),
            self._hold(self.prefill),
            Send(self.prefill, Prefill(work), t.call_s),
            Send(
                self.decode,
                QueueReservation(work, self.transfer_id, t.reserve_s, self.source_ranks),
                t.call_s,
            ),
        ]

    def answered(self, sent: Send, answer: object) -> list[Effect]:
        """``sent``'s command was answered ``answer``."""
        if self.over:
            return []
        cmd = sent.command
        if isinstance(cmd, AddLocal):
            return [TakenIn()]
        if isinstance(cmd, Prefill):
            self.prefill_taken = True
            return [TakenIn(), *self._set_target()]
        if isinstance(cmd, QueueReservation):
            if answer is not True:
                return self._refused()
            # Queued first, awaited then: once queued, an abort reaches the waiting reservation.
            wait = self.timeouts.reserve_s + self.timeouts.call_s
            return [Send(self.decode, AwaitReservation(self.request_id), wait)]
        if isinstance(cmd, AwaitReservation):
            if not isinstance(answer, KVTarget):
                return self._refused()
            self.target = answer
            self._reach(Stage.RESERVED)
            return [Reserved(), *self._set_target(), *self._start(), *self._send_kv_lost()]
        return []

    def call_failed(
        self, sent: Send, failure: Failure, message: str, field: str | None = None
    ) -> list[Effect]:
        """``sent``'s command failed (``message`` says how)."""
        if self.over or sent.quiet:
            return []
        cmd, gone = sent.command, failure in (Failure.LOST, Failure.TIMEOUT)
        if isinstance(cmd, Prefill) and gone and self.first is not None:
            # The first token came out before the answer did (two threads on the worker): the
            # request goes on, and decode recomputes the prompt.
            return self._lose_kv()
        if isinstance(cmd, SetTarget) and gone and self.first is not None:
            # Decode recomputes; prefill, should it live, lets go of the prompt's blocks.
            return [*self._lose_kv(), *self._let_go(self.prefill)]
        if isinstance(cmd, Start) and failure is not Failure.LOST:
            return self._fail(Code.UNAVAILABLE, f"decode worker {self.decode}: {message}")
        if failure is Failure.LOST:
            return self._relocate(message)
        if failure is Failure.TIMEOUT:
            return self._fail(Code.UNAVAILABLE, "a worker did not answer in time")
        if failure in (Failure.INVALID, Failure.VALUE):
            return self._fail(Code.INVALID_ARGUMENT, message, field)
        return self._fail(Code.INTERNAL, f"internal error: {message}")

    def on_delta(self, worker: str, d: TokenDelta) -> list[Effect]:
        """A worker's delta for this attempt. A worker the attempt does not use (one a migrated
        request moved away from) is fenced off: nothing."""
        if self.over or worker not in (self.prefill, self.decode):
            return []
        if d.kv_lost:
            # Prefill's push failed after the first token: it holds nothing any more.
            return [*self._drop(worker), *self._lose_kv()]
        if d.error is not None:
            return self._fail(Code.UNAVAILABLE, f"{worker}: {d.error}")
        if d.prefilled:
            # Prefill still holds the KV until it is pushed: it stays a holder (and gets an
            # abort if the request ends) until decode produces tokens.
            out: list[Effect] = [Deliver(worker, d)]
            if d.token_ids:
                self.first = (d.token_ids[0], d.num_cached_tokens)
                self._reach(Stage.FIRST_TOKEN)
                out += self._start()
            return out
        out = self._drop(self.prefill)  # prefill's last token was its first, or the KV arrived
        if worker == self.decode:
            self._reach(Stage.DECODING)
            if d.finished:
                out += self._drop(worker)
        return [*out, Deliver(worker, d)]

    def steady(self, worker: str, d: TokenDelta) -> bool:
        """Whether ``d`` is one more of decode's tokens that changes nothing here: the driver
        delivers it without asking ``on_delta`` (most deltas of a stream: the hot path)."""
        return (
            self.stage is Stage.DECODING
            and worker == self.decode
            and not (d.finished or d.kv_lost or d.prefilled)
            and d.error is None
        )

    def worker_lost(self, worker: str) -> list[Effect]:
        """``worker``, which holds the attempt, is lost (or leaves its pool)."""
        if self.over:
            return []
        if worker == self.prefill and self.first is not None:
            return [*self._let_go(worker), *self._lose_kv()]  # decode has the first token
        return self._relocate(f"worker {worker} is gone")

    def forget(self, worker: str) -> list[Effect]:
        """``worker`` let go of the attempt by itself (it gave the prompt back, or finished
        it); decode's tokens mean the KV arrived, so prefill is done too."""
        out = self._drop(worker)
        if worker == self.decode:
            out += self._drop(self.prefill)
        return out

    def end(self) -> list[Effect]:
        """The request ended (or moves on under a new id): every holder lets go of it."""
        if self.stage is Stage.ENDED:
            return []
        self.stage = Stage.ENDED
        out: list[Effect] = []
        for w in list(self.holders):
            out += self._let_go(w)
        return out

    # -- internals -------------------------------------------------------------------------------
    def _hold(self, worker: str) -> Hold:
        self.holders[worker] = None
        return Hold(worker)

    def _drop(self, worker: str | None) -> list[Effect]:
        if worker is None or worker not in self.holders:
            return []
        del self.holders[worker]
        return [Drop(worker)]

    def _let_go(self, worker: str | None) -> list[Effect]:
        if worker is None or worker not in self.holders:
            return []
        return [*self._drop(worker), Send(worker, Abort(self.request_id), self.timeouts.call_s, quiet=True)]

    def _set_target(self) -> list[Effect]:
        if self.target_sent or not self.prefill_taken or self.target is None or self.kv_lost:
            return []
        assert self.prefill is not None
        self.target_sent = True
        self._reach(Stage.TARGET_SET)
        return [Send(self.prefill, SetTarget(self.request_id, self.target), self.timeouts.call_s)]

    def _start(self) -> list[Effect]:
        if self.start_sent or self.first is None or self.target is None or self.prefill is None:
            return []
        self.start_sent = True
        self._reach(Stage.HANDED_OFF)
        token, cached = self.first
        return [Send(self.decode, Start(self.request_id, token, cached), self.timeouts.call_s)]

    def _lose_kv(self) -> list[Effect]:
        self.kv_lost = True
        return self._send_kv_lost()

    def _send_kv_lost(self) -> list[Effect]:
        """Tell decode the KV will not come, once it holds blocks for it (before, there is
        nothing to recompute into; a refused reservation fails the request anyway)."""
        if not self.kv_lost or self.kv_lost_sent or self.target is None:
            return []
        self.kv_lost_sent = True
        return [Send(self.decode, KvLost(self.request_id), self.timeouts.call_s, quiet=True)]

    def _refused(self) -> list[Effect]:
        wait = self.timeouts.reserve_s
        msg = f"no KV cache room on decode worker {self.decode} within {wait:g}s; retry later"
        return self._fail(Code.RESOURCE_EXHAUSTED, msg)

    def _fail(self, code: Code, message: str, field: str | None = None) -> list[Effect]:
        self._reach(Stage.FAILED)
        return [Fail(code, message, field)]

    def _relocate(self, why: str) -> list[Effect]:
        self._reach(Stage.FAILED)
        return [Relocate(why)]


def why_not_migrate(
    fault_moves: int, limit: int, has_decoders: bool, planned: bool = False, decode_role: str = "decode"
) -> str | None:
    """Why a request whose worker is gone cannot move to another one (``None``: it can).
    ``fault_moves``: its moves so far that a lost worker caused; only those count against
    ``limit`` (``--migration-limit``): a ``planned`` move is bounded by the planner's own rate."""
    if not planned and limit <= 0:
        return "request migration is off (--migration-limit 0)"
    if not planned and fault_moves >= limit:
        return f"the stream already moved {fault_moves} times after faults (--migration-limit {limit})"
    if not has_decoders:
        return f"no healthy {decode_role} worker is left to move it to"
    return None
