"""Requests waiting for their constraint's grammar before they may be scheduled.

A constrained request enters the batch only once its grammar is compiled, so no step ever
waits for a compile: the compile runs on its own thread (``structured.compiler``) while the
batch goes on. State of one request here::

    hold(req, then) --compiled, and its tokens so far accepted--> then() (scheduled)
                    --refused (or its tokens outside the constraint)--> failed: an error for it
                    --drop (abort, withdraw)--> gone

``then`` runs on the engine's thread, in ``poll`` (or in ``hold`` when the grammar is ready
already, the common case: the worker has compiled a constraint seen before; ``hold`` then
raises a refusal at once, ``poll`` returns the later ones).
A request's tokens so far (the first token another worker sampled, a migrated request's
output) are checked against the constraint before it is scheduled: the sampler replays them,
and a token outside the grammar must end the request here with an error, never later with
invalid output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.structured.constraint import Constraint


class Compiles(Protocol):
    """What the gate needs of ``structured.compiler.Grammars``."""

    def load(self) -> None: ...

    def ready(self, c: Constraint) -> bool: ...

    def accepts(self, c: Constraint, tokens: Sequence[int]) -> bool: ...


@dataclass
class _Held:
    request: Request
    then: Callable[[], None]


class GrammarGate:
    def __init__(self, grammars: Compiles | None) -> None:
        self.grammars = grammars
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def check_supported(self, c: Constraint | None) -> None:
        """Refuse a constrained request a worker without grammars (no tokenizer, or a runner
        that computes no logits) cannot serve."""
        if c is not None and self.grammars is None:
            raise InvalidRequestError(
                "response_format", "this worker cannot constrain output (no tokenizer or no model logits)"
            )

    def prepare(self, c: Constraint | None) -> None:
        """Start the constraint's compile now (a reservation, long before the request is
        scheduled); ``InvalidRequestError`` if this worker cannot constrain at all."""
        self.check_supported(c)
        if c is not None and self.grammars is not None:
            self.grammars.load()
            self.grammars.ready(c)

    def hold(self, req: Request, then: Callable[[], None]) -> None:
        """Run ``then`` once the request's grammar is ready (now, if it is). Raises
        ``InvalidRequestError`` (and never runs ``then``) if it is ready and refused."""
        c = req.params.constraint
        if c is None:
            then()
            return
        self.check_supported(c)
        assert self.grammars is not None
        self.grammars.load()  # here, on the engine's thread, the first time (see ``Grammars.load``)
        if not self.grammars.ready(c):
            self._held[req.request_id] = _Held(req, then)
            return
        self._release(req, then)

    def drop(self, request_id: str) -> bool:
        return self._held.pop(request_id, None) is not None

    def poll(self) -> list[tuple[Request, str]]:
        """Schedule the requests whose grammar became ready; the ones refused, with why."""
        failed = []
        assert self.grammars is not None or not self._held
        for rid, h in list(self._held.items()):
            c = h.request.params.constraint
            assert c is not None and self.grammars is not None
            if self.grammars.ready(c):
                del self._held[rid]
                try:
                    self._release(h.request, h.then)
                except InvalidRequestError as e:
                    failed.append((h.request, str(e)))
        return failed

    def _release(self, req: Request, then: Callable[[], None]) -> None:
        c = req.params.constraint
        assert c is not None and self.grammars is not None
        if not self.grammars.accepts(c, req.output_token_ids):  # raises if the grammar was refused
            raise InvalidRequestError("output_token_ids", "the tokens so far are outside the constraint")
        then()
