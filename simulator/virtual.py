"""The virtual side of a worker's ports (pure): what the simulator plugs into the real role
engines in place of a GPU, a KV transport and the wall clock (``pdserve.worker.ports``).

- ``Clock``: the event queue; its ``now`` is every simulated engine's clock.
- ``SimRunner``: runs no model. It samples a fixed token for every chunk that samples and
  remembers the step's chunks, whose duration the simulated worker asks the step-time model
  for (the engine's state moves at the step's start; what it reports leaves at its end).
- ``SimRuntime``: the runner with a real ``KVCacheManager`` and limits that let every
  workload request through (the workload was checked against the profile's context already).
- ``Link`` and ``SimTransport``: a transfer takes the profile's link time for the request's
  prompt from when it can start (the end of the step that computed the prompt's last chunk,
  or at once for a push started between steps); both ends learn of it then. A cancelled
  transfer is reported failed (``CANCELLED``) on the end that cancelled it, as the real
  transport does, and is dropped from the link.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.kvtransfer.states import Completions, FailureCause
from pdserve.model_runtime.engine.runner import DoneStep, StepResult
from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.scheduler.plan import ScheduledChunk
from pdserve.model_runtime.validation import RequestLimits
from pdserve.steptime.model import StepTimeModel

TOKEN = 1  # every sampled token: content does not matter to scheduling
VOCAB = 1 << 31  # simulated prompts carry whatever ids the workload made up


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.stopped = False

    def __call__(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self) -> None:
        while self._events and not self.stopped:
            self.now, _, fn = heapq.heappop(self._events)
            fn()

    def stop(self) -> None:
        """End ``run`` after the event in progress (events still queued are dropped)."""
        self.stopped = True


class SimRunner:
    def __init__(self) -> None:
        self.chunks: Sequence[ScheduledChunk] = ()  # the last step's

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        self.chunks = chunks
        if on_layer is not None:
            on_layer(0)
        return StepResult({c.request_id: TOKEN for c in chunks if c.sample}, {})

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> DoneStep:
        return DoneStep(self.execute(chunks, requests))

    def release(self, request_id: str) -> None:
        pass

    def kept_requests(self) -> int:
        return 0

    def take(self) -> Sequence[ScheduledChunk]:
        """The chunks of the step run since the last call (none if the engine computed none)."""
        chunks, self.chunks = self.chunks, ()
        return chunks


@dataclass
class SimRuntime:
    kv: KVCacheManager
    block_size: int
    max_model_len: int
    runner: SimRunner = field(default_factory=SimRunner)
    eos_ids: frozenset[int] = frozenset()
    grammars: None = None  # no structured output

    def limits(self, max_prompt_tokens: int = 0, max_tokens_cap: int = 0) -> RequestLimits:
        return RequestLimits(VOCAB, self.max_model_len, self.block_size, self.kv.num_blocks, 0, False)


class Link:
    """Every simulated transport's peer: times transfers on the clock."""

    def __init__(self, clock: Clock, profile: StepTimeModel) -> None:
        self.clock = clock
        self.profile = profile
        self.tokens: dict[str, int] = {}  # transfer id -> prompt tokens (the router mints both)
        self.ends: dict[str, SimTransport] = {}  # address -> transport
        self._live: dict[str, tuple[SimTransport, SimTransport]] = {}  # transfer id -> (sender, receiver)

    def start(self, transfer_id: str, sender: SimTransport, receiver: str, at: float) -> None:
        dst = self.ends[receiver]
        self._live[transfer_id] = (sender, dst)
        done = at + self.profile.transfer_time(self.tokens[transfer_id])
        self.clock.at(done, lambda: self._finish(transfer_id))

    def _finish(self, transfer_id: str) -> None:
        ends = self._live.pop(transfer_id, None)
        self.tokens.pop(transfer_id, None)
        if ends is None:  # cancelled meanwhile
            return
        sender, receiver = ends
        sender.complete(transfer_id, sending=True)
        receiver.complete(transfer_id, sending=False)

    def cancel(self, transfer_id: str) -> bool:
        """Fail a live transfer at both ends (the other end's view: the peer gave up); False
        if it is not live."""
        ends = self._live.pop(transfer_id, None)
        if ends is None:
            return False
        for end in ends:
            end.fail(transfer_id)
        return True

    def forget(self, transfer_id: str) -> None:
        if transfer_id not in self._live:
            self.tokens.pop(transfer_id, None)


class SimTransport:
    def __init__(self, address: str, link: Link, on_completion: Callable[[], None]) -> None:
        self.address = address
        self.offers = ["sim"]
        self.rank_addresses: tuple[str, ...] = ()  # one rank: the simulator moves no shards
        self.settling = False  # (one part a transfer: nothing outlives its transfer)
        self.link = link
        link.ends[address] = self
        self._on_completion = on_completion
        self._done = Completions()
        self._records: set[str] = set()  # expected or sent, until forgotten
        self._ended: set[str] = set()  # reported finished or failed, until forgotten
        self._queued: list[tuple[str, str]] = []  # (transfer id, peer): sent, not started yet

    def expect(
        self, transfer_id: str, dst_blocks: Sequence[int], source_ranks: int = 1, lease_s: float | None = None
    ) -> None:
        self._records.add(transfer_id)

    def send(
        self,
        transfer_id: str,
        peer: str,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        layerwise: bool = False,
        timeout_s: float | None = None,
        peer_offers: Sequence[str] | None = None,
        peer_ranks: Sequence[str] = (),
    ) -> None:
        self._records.add(transfer_id)
        self._queued.append((transfer_id, peer))

    def start_queued(self, at: float) -> None:
        """Start the pushes queued since the last call, at ``at`` (the end of the step that
        queued them, or now)."""
        for tid, peer in self._queued:
            self.link.start(tid, self, peer, at)
        self._queued.clear()

    def layer_ready(self, transfer_id: str, layer: int) -> None:
        pass

    def cancel(self, transfer_id: str) -> None:
        """Cancel a transfer not ended yet: a live one fails at both ends, one not started at
        this end (a push still queued, or a receive whose sender never began)."""
        if transfer_id not in self._records or transfer_id in self._ended:
            return
        self._queued = [q for q in self._queued if q[0] != transfer_id]
        if not self.link.cancel(transfer_id):
            self.fail(transfer_id)

    def complete(self, transfer_id: str, sending: bool) -> None:
        self._ended.add(transfer_id)
        (self._done.finished_sending if sending else self._done.finished_receiving).add(transfer_id)
        self._on_completion()

    def fail(self, transfer_id: str) -> None:
        if transfer_id in self._records and transfer_id not in self._ended:
            self._ended.add(transfer_id)
            self._done.failed[transfer_id] = FailureCause.CANCELLED
            self._on_completion()

    @property
    def has_completions(self) -> bool:
        return bool(self._done)

    def poll(self) -> Completions:
        done, self._done = self._done, Completions()
        return done

    def forget(self, transfer_id: str) -> None:
        self._records.discard(transfer_id)
        self._ended.discard(transfer_id)
        self.link.forget(transfer_id)

    def num_records(self) -> int:
        return len(self._records)
