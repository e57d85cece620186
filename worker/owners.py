"""Which router connection owns each request on this worker, and the work each one placed here
(pure Python).

With router replicas a worker has one channel per replica (and one to the pool owner). The
connection a request's introducing command arrived on (``Prefill``, ``QueueReservation``,
``AddLocal``) owns it: its deltas go there only. Every load report tells each connection the
work the *other* connections placed here (``WorkerLoad.others``), which its own ledger cannot
see. ``Owners`` keeps both, updated from the commands and the deltas as the router's
``Ledger`` is from routing, first tokens and ends::

    introduce(owner, cmd)    Prefill: a prefill of the prompt (and any output tokens carried)
                             QueueReservation: a decode entry; AddLocal: both
    command(cmd, answer)     Start: the first token is out (one less to generate here)
                             Withdraw answered True, Abort: the request is gone
    on_delta(delta)          prefilled, or the first token of a local prefill: the prefill part
                             ends; each token: one less to generate; finished or kv_lost: gone

A decode entry counts as the router's ledger counts it: context = the tokens already in the
sequence + half of those still to generate (its mean context while decoding, as
``pdserve.router.goodput`` computes it), fixed for the request's life; remaining = the tokens
still to generate at most, lowered by each token the worker reports.

A prefill worker's request is forgotten with its first token (the prompt is handed off and
nothing of it is left here to count, and an idle worker keeps no per-request state): a
``kv_lost`` that may follow it has no owner here, and the channel sends it to every router
(each ignores an id it does not hold).

Every call is O(1) (``owned_by`` and ``others`` aside, O(requests owned) and O(1)): running
totals per owner and in all. Not thread-safe: the caller serializes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.worker.commands import Abort, AddLocal, Command, Prefill, QueueReservation, Start, Withdraw
from pdserve.worker.messages import PlacedWork, TokenDelta, WorkItem

Introducing = Prefill | QueueReservation | AddLocal


@dataclass(slots=True)
class _Entry:
    owner: int
    prefill_tokens: int  # > 0 until the first token is out: a prefill queued or running
    decode: bool  # a decode entry (reserved, or admitted to the batch)
    context: int
    remaining: int


@dataclass(slots=True)
class _Sums:
    prefills: int = 0
    prefill_tokens: int = 0
    decodes: int = 0
    decode_context: int = 0
    decode_remaining: int = 0

    def add(self, e: _Entry, sign: int) -> None:
        if e.prefill_tokens:
            self.prefills += sign
            self.prefill_tokens += sign * e.prefill_tokens
        if e.decode:
            self.decodes += sign
            self.decode_context += sign * e.context
            self.decode_remaining += sign * e.remaining

    def minus(self, other: _Sums) -> PlacedWork:
        return PlacedWork(
            self.prefills - other.prefills,
            self.prefill_tokens - other.prefill_tokens,
            self.decodes - other.decodes,
            self.decode_context - other.decode_context,
            self.decode_remaining - other.decode_remaining,
        )


_NONE = _Sums()


def placed_entry(owner: int, cmd: Introducing) -> _Entry:
    """What ``cmd`` places on the worker, as ``owner``'s entry."""
    work: WorkItem = cmd.work
    sent = len(work.output_token_ids)
    context = len(work.prompt_token_ids) + sent
    remaining = max(0, work.params.max_tokens - sent)
    prefill = context if not isinstance(cmd, QueueReservation) else 0
    decode = not isinstance(cmd, Prefill)
    # the router's mean context (``goodput._mean_context``): the sequence + half still to come
    return _Entry(
        owner, prefill, decode, context + remaining // 2 if decode else 0, remaining if decode else 0
    )


class Owners:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._by_owner: dict[int, dict[str, None]] = {}  # owner -> its request ids (in order)
        self._sums: dict[int, _Sums] = {}
        self._total = _Sums()

    # -- commands ----------------------------------------------------------------------------
    def introduce(self, owner: int, cmd: Introducing) -> None:
        """``cmd`` arrived on connection ``owner``, before the engine runs it (no delta of its
        request can precede it). Raises ``ValueError`` for an id already here: the engine would
        refuse it too, and the request already here keeps its owner."""
        rid = cmd.work.request_id
        if rid in self._entries:
            raise ValueError(f"request {rid!r} is already on this worker")
        e = placed_entry(owner, cmd)
        self._entries[rid] = e
        self._by_owner.setdefault(owner, {})[rid] = None
        self._sums.setdefault(owner, _Sums()).add(e, 1)
        self._total.add(e, 1)

    def command(self, cmd: Command, answer: object = None) -> None:
        """A command that names a request ran, answered ``answer`` (an introducing one goes
        through ``introduce``; one that failed with an error need not come here: the router
        aborts its request)."""
        if isinstance(cmd, Abort) or (isinstance(cmd, Withdraw) and answer is True):
            self.forget(cmd.request_id)
        elif isinstance(cmd, Start):
            e = self._entries.get(cmd.request_id)
            if e is not None and e.decode:
                self._set_remaining(e, e.remaining - 1)  # prefill sampled the first token

    # -- deltas ------------------------------------------------------------------------------
    def on_delta(self, delta: TokenDelta) -> int | None:
        """The owner to send ``delta`` to (``None``: unknown here, e.g. aborted since), with
        the request's work updated by what the delta says."""
        rid = delta.request_id
        e = self._entries.get(rid)
        if e is None:
            return None
        if delta.finished or delta.kv_lost:
            self.forget(rid)
            return e.owner
        n = len(delta.token_ids)
        if e.prefill_tokens and (delta.prefilled or n):
            self._end_prefill(rid, e)
        if e.decode and n:
            self._set_remaining(e, e.remaining - n)
        return e.owner

    def tokens(self, rid: str, n: int) -> None:
        """``n`` tokens of ``rid`` reported without a delta object, as one delta of them (not
        its last) would be (the simulator's steady steps)."""
        e = self._entries.get(rid)
        if e is None or n <= 0:
            return
        if e.prefill_tokens:
            self._end_prefill(rid, e)
        if e.decode:
            self._set_remaining(e, e.remaining - n)

    def _end_prefill(self, rid: str, e: _Entry) -> None:
        s = self._sums[e.owner]
        s.prefills -= 1
        s.prefill_tokens -= e.prefill_tokens
        self._total.prefills -= 1
        self._total.prefill_tokens -= e.prefill_tokens
        e.prefill_tokens = 0
        if not e.decode:  # a prefill worker's, handed off: nothing of it is left here to count
            self.forget(rid)

    def _set_remaining(self, e: _Entry, remaining: int) -> None:
        remaining = max(0, remaining)
        d = remaining - e.remaining
        e.remaining = remaining
        self._sums[e.owner].decode_remaining += d
        self._total.decode_remaining += d

    # -- reading -----------------------------------------------------------------------------
    def forget(self, rid: str) -> None:
        """``rid`` left the worker (nothing more will come for it)."""
        e = self._entries.pop(rid, None)
        if e is None:
            return
        self._sums[e.owner].add(e, -1)
        self._total.add(e, -1)
        owned = self._by_owner[e.owner]
        del owned[rid]
        if not owned:  # an owner that holds nothing leaves no trace
            del self._by_owner[e.owner]
            del self._sums[e.owner]

    def owner_of(self, rid: str) -> int | None:
        e = self._entries.get(rid)
        return None if e is None else e.owner

    def others(self, owner: int) -> PlacedWork:
        """The work every connection but ``owner`` placed here (``WorkerLoad.others``)."""
        return self._total.minus(self._sums.get(owner, _NONE))

    def placed(self, owner: int) -> PlacedWork:
        """The work ``owner`` placed here."""
        return self._sums.get(owner, _NONE).minus(_NONE)

    def total(self) -> PlacedWork:
        """The work every connection placed here."""
        return self._total.minus(_NONE)

    def owned_by(self, owner: int) -> list[str]:
        """``owner``'s request ids, oldest first (a lost replica's, to abort)."""
        return list(self._by_owner.get(owner, ()))

    def __len__(self) -> int:
        return len(self._entries)
