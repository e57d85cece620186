"""One request's KV hand-off as several transfers, one per re-sharding route (pure).

Between a prefill worker of degree ``p`` and a decode worker of degree ``d``, a request's KV
moves as one transfer per ``Route`` (``model_runtime.parallel.reshard``): prefill rank ``s``
sends heads to decode rank ``r`` under the part's own id, on those two ranks' transports. The
engines still speak of the request's one transfer id; ``PartTable`` maps it to its parts and
folds the parts' outcomes into the transfer's.

Outcome: the transfer finishes when every part has; it fails, with the first failed part's
cause, as soon as one part fails (the caller cancels the others). A part's record on its rank
is forgotten once the part ended and the engine forgot the transfer — whichever comes last —
so no rank keeps a record of a transfer its engine no longer knows.

States of a part: live ─▶ ended (finished or failed) ─▶ forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.kvtransfer.states import Completions, FailureCause


def part_id(transfer_id: str, src_rank: int, dst_rank: int, whole: bool) -> str:
    """A part's transfer id; the transfer's own id when it is the only part of a TP 1 → TP 1
    hand-off (the wire then carries exactly what it always did)."""
    return transfer_id if whole else f"{transfer_id}#{src_rank}>{dst_rank}"


@dataclass(frozen=True)
class Part:
    rank: int  # the rank of this worker whose transport runs it
    id: str


@dataclass
class _Transfer:
    parts: dict[str, Part]
    receiving: bool
    ended: dict[str, FailureCause | None] = field(default_factory=dict)  # part id -> None: finished
    reported: bool = False
    forgotten: bool = False


class PartTable:
    def __init__(self) -> None:
        self._transfers: dict[str, _Transfer] = {}
        self._parent: dict[str, str] = {}  # part id -> transfer id

    def add(self, transfer_id: str, parts: Iterable[Part], receiving: bool) -> None:
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} is already in flight")
        ps = {p.id: p for p in parts}
        if not ps:
            raise ValueError(f"transfer {transfer_id!r} has no parts")
        clash = [pid for pid in ps if pid in self._parent]
        if clash:
            raise ValueError(f"transfer part {clash[0]!r} is already in flight")
        self._transfers[transfer_id] = _Transfer(ps, receiving)
        for pid in ps:
            self._parent[pid] = transfer_id

    def parts(self, transfer_id: str) -> list[Part]:
        t = self._transfers.get(transfer_id)
        return list(t.parts.values()) if t is not None else []

    def live_parts(self, transfer_id: str) -> list[Part]:
        t = self._transfers.get(transfer_id)
        return [p for pid, p in t.parts.items() if pid not in t.ended] if t is not None else []

    def fold(self, rank_completions: Iterable[Completions]) -> tuple[Completions, list[Part]]:
        """The transfers' outcomes newly known from the parts' (every rank's ``poll``), and the
        parts whose records may now be forgotten on their ranks."""
        out = Completions()
        touched: set[str] = set()
        for c in rank_completions:
            for pid in (*c.finished_sending, *c.finished_receiving):
                self._end(pid, None, touched)
            for pid, cause in c.failed.items():
                self._end(pid, cause, touched)
        forgettable: list[Part] = []
        for tid in sorted(touched):
            t = self._transfers[tid]
            if not t.reported:
                failed = [cause for cause in t.ended.values() if cause is not None]
                if failed:
                    out.failed[tid] = failed[0]
                    t.reported = True
                elif len(t.ended) == len(t.parts):
                    t.reported = True
                    (out.finished_receiving if t.receiving else out.finished_sending).add(tid)
            forgettable += self._release(tid)
        return out, forgettable

    def _end(self, pid: str, cause: FailureCause | None, touched: set[str]) -> None:
        tid = self._parent.get(pid)
        if tid is None:
            return
        t = self._transfers[tid]
        if pid not in t.ended:
            t.ended[pid] = cause
            touched.add(tid)

    def forget(self, transfer_id: str) -> list[Part]:
        """The engine is done with the transfer; the parts to forget on their ranks now (the
        others are forgotten as they end)."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return []
        t.forgotten = True
        return self._release(transfer_id)

    def _release(self, tid: str) -> list[Part]:
        t = self._transfers[tid]
        if not t.forgotten:
            return []
        done = [p for pid, p in t.parts.items() if pid in t.ended]
        for p in done:
            del t.parts[p.id]
            del self._parent[p.id]
        if not t.parts:
            del self._transfers[tid]
        return done

    @property
    def settling(self) -> bool:
        """Parts of a transfer the engine already forgot are still to end (a failed part's
        siblings, cancelled): their outcomes must still be polled for, to release them."""
        return any(t.forgotten for t in self._transfers.values())

    def __len__(self) -> int:
        return len(self._transfers)
