"""One request as the router sees it: worker deltas in, client events out.

``RequestStream`` is fed ``TokenDelta``s by the output pollers (prefill's first token, then
decode's batches), detokenizes them, applies stop strings, keeps timing, and queues
``Chunk``s and one terminal ``Final`` (or a ``RouterError``) for the API layer to read; the
chunks its reader has not taken yet are joined into one.

States::

    DISPATCHING --first token--> STREAMING --finished | stop string--> DONE
         |                           |
         +-------- error / abort ----+--> DONE (Final with "abort", or a RouterError)
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.model_runtime.request import Usage
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.text_stream import TextStream
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.router.errors import RouterError
from pdserve.router.lifecycle import Attempt
from pdserve.router.slo import SloClass
from pdserve.worker.messages import Logprob, TokenDelta, WorkItem


class StreamState(enum.Enum):
    DISPATCHING = "dispatching"
    STREAMING = "streaming"
    DONE = "done"


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[Logprob, ...] | None

    def join(self, later: Chunk) -> Chunk:
        """This chunk and the one after it, as one."""
        lps = self.logprobs
        if lps is not None or later.logprobs is not None:
            lps = (lps or ()) + (later.logprobs or ())
        return Chunk(self.token_ids + later.token_ids, self.text + later.text, lps)


@dataclass(frozen=True)
class Timing:
    """Milliseconds, measured at the router from the request's arrival. ``queue_ms`` ends when
    the worker that prefills the prompt took it in (its engine's queue holds it), or at the first
    token if that is seen first, so ``queue_ms <= ttft_ms`` always; ``ttft_ms`` ends when the
    first token leaves the router (``proto/pdserve/v1/inference.proto``, ``Timing``)."""

    queue_ms: float
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float


@dataclass(frozen=True)
class Final:
    request_id: str
    finish_reason: str  # stop | length | stop_string | abort
    stop_reason: str | int | None
    usage: Usage
    timing: Timing
    prefill_worker: str
    decode_worker: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str | None
    migrations: int = 0  # times the stream moved to another decode worker (lost, or leaving its pool)


Event = Chunk | Final


class RequestStream:
    def __init__(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        tokenizer: TextTokenizer | None,
        client_id: str = "",
    ) -> None:
        self.request_id = request_id  # minted by the router: the only id workers ever see
        self.client_id = client_id or request_id  # the client's, echoed back in ``Final``
        self.prompt_ids = prompt_ids
        self.params = params
        self.text = TextStream(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output)
        self.state = StreamState.DISPATCHING
        self.arrival = time.perf_counter()
        self.attempt_at = self.arrival  # when the current attempt was dispatched (a restart's)
        self.dispatched: float | None = None  # the first attempt's prompt was taken in (``taken_in``)
        self.first_token: float | None = None
        self.token_ids: list[int] = []
        self.cached_tokens = 0  # of the prompt (a migrated request's recompute may hit more)
        self.slo: SloClass | None = None  # its class, for the routing of a migrated attempt
        self.prefill_worker = ""
        self.decode_worker = ""
        self.last_token: float | None = None
        self.itls: list[float] = []  # gaps between token arrivals at the router
        self.handed_off = False  # decode's first token after a remote prefill has arrived
        self.final_event: Final | None = None
        self.error: RouterError | None = None
        # What the reader has not taken yet, and the future it waits on while there is nothing:
        # chunks that pile up behind a slow reader (or arrive together) are joined into one.
        self._unread: list[Event | RouterError] = []
        self._reader: asyncio.Future[None] | None = None
        self.migrations = 0  # every move to another worker (reported to the client)
        self.fault_migrations = 0  # the moves a lost worker caused (bounded by --migration-limit)
        self.work: WorkItem | None = None  # what the workers were sent (a migration resends it)
        self.attempt: Attempt | None = None  # the current attempt's state machine
        self.calls: set[asyncio.Task[None]] = set()  # its commands' answers awaited
        self.reserved_at = 0.0  # when decode reserved blocks for its KV (perf_counter)

    def restart(self, request_id: str) -> None:
        """A new attempt under a new id (migration, a prompt routed again): the tokens sent
        stay; the per-attempt dispatch state starts afresh."""
        self.request_id = request_id
        self.attempt_at = time.perf_counter()
        self.prefill_worker = self.decode_worker = ""
        self.reserved_at = 0.0
        self.handed_off = False
        self.attempt = None

    def taken_in(self) -> None:
        """The worker that prefills the prompt holds it: the router's part of queueing is over
        (the first attempt's; whatever moves later, queueing ended there)."""
        if self.dispatched is None:
            self.dispatched = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.state is StreamState.DONE

    def feed(self, delta: TokenDelta) -> bool:
        """Apply a worker's delta; True when the request is over (stop string or finished)."""
        if self.done:
            return True
        now = time.perf_counter()
        n = len(delta.token_ids)
        if n and self.first_token is None:
            self.first_token = now
            self.state = StreamState.STREAMING
        elif n and self.last_token is not None:
            # A delta of n tokens (a worker's steps since its last send) took the gap to make:
            # each token's share of it, as n deltas of one token would have arrived.
            self.itls.extend([(now - self.last_token) / n] * n)
        if n:
            self.last_token = now
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        text, taken = self.text.add(delta.token_ids)
        ids = delta.token_ids[:taken]
        self.token_ids.extend(ids)
        lps = delta.logprobs[:taken] if delta.logprobs is not None else None
        if self.text.matched is not None or delta.finished:
            text += self.text.finish()  # may itself complete a stop string
        stopped = self.text.matched is not None
        if ids or text:
            self._put(Chunk(tuple(ids), text, lps))
        if stopped:
            self._end("stop_string", self.text.matched)
        elif delta.finished:
            reason = delta.finish_reason or "stop"
            self._end(reason, delta.stop_token_id)
        return self.done

    def abort(self) -> None:
        """End with finish reason "abort" (client or operator asked)."""
        if not self.done:
            self._end("abort", None)

    def fail(self, error: RouterError) -> None:
        if not self.done:
            self.state = StreamState.DONE
            self.error = error
            self._put(error)

    def _end(self, reason: str, stop_reason: str | int | None) -> None:
        self.state = StreamState.DONE
        self.final_event = self.final(reason, stop_reason)
        self._put(self.final_event)

    def final(self, reason: str, stop_reason: str | int | None) -> Final:
        now = time.perf_counter()
        e2e = (now - self.arrival) * 1000
        first = self.first_token or now
        ttft = (first - self.arrival) * 1000
        # The answer that says the prompt was taken in and the first token travel apart (two
        # threads on the worker, two tasks here): the token may be seen first.
        queued_until = min(self.dispatched or first, first)
        n = len(self.token_ids)
        return Final(
            request_id=self.client_id,
            finish_reason=reason,
            stop_reason=stop_reason,
            usage=Usage(len(self.prompt_ids), n, min(self.cached_tokens, len(self.prompt_ids))),
            timing=Timing(
                queue_ms=(queued_until - self.arrival) * 1000,
                ttft_ms=ttft,
                tpot_ms=(e2e - ttft) / (n - 1) if n > 1 else 0.0,
                e2e_ms=e2e,
            ),
            prefill_worker=self.prefill_worker,
            decode_worker=self.decode_worker,
            prompt_token_ids=self.prompt_ids,
            token_ids=tuple(self.token_ids),
            text=self.text.text,
            migrations=self.migrations,
        )

    def _put(self, ev: Event | RouterError) -> None:
        unread = self._unread
        if unread and isinstance(ev, Chunk) and isinstance(last := unread[-1], Chunk):
            unread[-1] = last.join(ev)
        else:
            unread.append(ev)
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    async def events(self) -> AsyncIterator[Event]:
        """Chunks as they come (those that arrived since the last one was read, as one), then
        the ``Final``; raises the ``RouterError`` of a failure."""
        while True:
            if not self._unread:
                self._reader = asyncio.get_running_loop().create_future()
                await self._reader
                self._reader = None
            batch, self._unread = self._unread, []
            for ev in batch:
                if isinstance(ev, RouterError):
                    raise ev
                yield ev
                if isinstance(ev, Final):
                    return
