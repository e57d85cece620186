"""Which connections a listener keeps while they have not authenticated yet (pure).

A listener that authenticates its peers (the KV receiver, the router's worker channel) cannot
tell a real peer from a flood until the handshake is done, so connections that have not
authenticated are bounded on their own: per peer address and in total. A new connection over
either bound sheds the oldest unauthenticated one (of its own address first), never the new one.
A flood of idle connections then keeps each of its sockets for only as long as it takes the
flood to open ``total`` more, while a real peer's handshake (milliseconds) completes; refusing
the newest instead would leave every slot to the flood, as a fixed pool of slots each held for
the handshake deadline did (every hand-off failed). Authenticated connections are bounded
separately by their owner.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

C = TypeVar("C")

MAX_PENDING_PER_PEER = 16
MAX_PENDING = 64


class PendingConnections(Generic[C]):
    """Unauthenticated connections, oldest first. Not thread-safe: its owner locks."""

    def __init__(self, per_peer: int = MAX_PENDING_PER_PEER, total: int = MAX_PENDING) -> None:
        if not 1 <= per_peer <= total:
            raise ValueError(f"need 1 <= per_peer ({per_peer}) <= total ({total})")
        self.per_peer = per_peer
        self.total = total
        self._peer: OrderedDict[C, str] = OrderedDict()  # connection -> its peer's address
        self.shed = 0  # connections shed so far (a flood shows here)

    def __len__(self) -> int:
        return len(self._peer)

    def __contains__(self, conn: object) -> bool:
        return conn in self._peer

    def admit(self, conn: C, peer: str) -> list[C]:
        """Take ``conn`` (from address ``peer``) in; returns the connections to close for it."""
        if conn in self._peer:
            raise ValueError("connection admitted twice")
        out: list[C] = []
        same = [c for c, p in self._peer.items() if p == peer]
        if len(same) >= self.per_peer:
            out.append(same[0])
            del self._peer[same[0]]
        elif len(self._peer) >= self.total:
            oldest = next(iter(self._peer))
            out.append(oldest)
            del self._peer[oldest]
        self._peer[conn] = peer
        self.shed += len(out)
        return out

    def settled(self, conn: C) -> None:
        """``conn`` authenticated, failed or closed: it no longer counts."""
        self._peer.pop(conn, None)
