"""The bound on connections that have not authenticated (``pdserve.kvtransfer.admission``): a new
connection is never the one shed; the oldest of its own address goes when that address is at its
bound, else the oldest of all when the total is; nothing else is ever shed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kvtransfer.admission import PendingConnections

events = st.lists(st.tuples(st.booleans(), st.sampled_from("abcd")), max_size=200)


@given(st.integers(1, 5), st.integers(0, 6), events)
def test_bounds_hold_and_the_oldest_goes(per_peer: int, extra: int, evs: list[tuple[bool, str]]) -> None:
    total = per_peer + extra
    p: PendingConnections[int] = PendingConnections(per_peer, total)
    model: list[tuple[int, str]] = []  # (connection, peer), oldest first
    for n, (arrive, peer) in enumerate(evs):
        if not arrive and model:
            conn, _ = model.pop(n % len(model))
            p.settled(conn)
            continue
        same = [c for c, q in model if q == peer]
        want = [same[0]] if len(same) >= per_peer else [model[0][0]] if len(model) >= total else []
        assert p.admit(n, peer) == want
        model = [(c, q) for c, q in model if c not in want] + [(n, peer)]
        assert n in p and len(p) == len(model) <= total
        assert all(sum(q == peer for _, q in model) <= per_peer for peer in "abcd")


def test_a_connection_cannot_be_admitted_twice_and_bounds_must_make_sense() -> None:
    p: PendingConnections[str] = PendingConnections(1, 2)
    p.admit("x", "h")
    with pytest.raises(ValueError, match="twice"):
        p.admit("x", "h")
    assert p.admit("y", "h") == ["x"] and p.shed == 1
    p.settled("y")
    p.settled("nothing")  # (settling twice, or what was shed, is no error)
    assert len(p) == 0
    with pytest.raises(ValueError):
        PendingConnections(3, 2)
