"""Request state -> ``TokenDelta`` (shared by both roles)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling.logprob import Logprob
from pdserve.worker.messages import TokenDelta


def delta_for(
    req: Request, since: int, logprobs: Sequence[Logprob] = (), prefilled: bool = False
) -> TokenDelta:
    """Tokens ``req`` generated from output index ``since`` on, and whether it ended."""
    stop_id = req.stop_reason if isinstance(req.stop_reason, int) else None
    return TokenDelta(
        request_id=req.request_id,
        token_ids=tuple(req.output_token_ids[since:]),
        logprobs=tuple(logprobs) if req.params.logprobs is not None else None,
        finished=req.is_finished,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        stop_token_id=stop_id,
        num_cached_tokens=req.num_cached_tokens,
        prefilled=prefilled,
    )


def error_delta(request_id: str, message: str) -> TokenDelta:
    return TokenDelta(request_id, (), finished=True, finish_reason="error", error=message)


class Tombstones:
    """Ids the router aborted while the call adding them had failed or timed out on its side
    (so it may still arrive): a late add for such an id is refused, and takes the id out,
    instead of starting work nobody will collect. The router waits for an add's answer before
    aborting otherwise, so this stays empty in normal operation. Bounded in number and age: an
    add that has not arrived after ``ttl_s`` never will (the router's call gave up long ago).
    """

    def __init__(self, capacity: int = 4096, ttl_s: float = 120.0) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._ids: OrderedDict[str, float] = OrderedDict()  # id -> when it was added

    def add(self, request_id: str) -> None:
        self._ids[request_id] = time.monotonic()
        self._ids.move_to_end(request_id)
        self._prune()

    def _prune(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._ids and (len(self._ids) > self.capacity or next(iter(self._ids.values())) < cutoff):
            self._ids.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """True (once) if ``request_id`` was aborted before it arrived."""
        if request_id not in self._ids:
            return False
        del self._ids[request_id]
        return True

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        self._prune()
        return len(self._ids)
