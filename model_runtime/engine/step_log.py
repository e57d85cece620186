"""A worker's record of every forward step it runs: what calibrates the simulator against the
service itself rather than against the engine measured alone (``pdserve profile``).

One JSON line per step, ``{"t0": start, "t1": end, "chunks": [[new, cached], ...]}``, with the
chunks in the convention of every latency profile (``new`` tokens after ``cached`` ones, a
decode token being ``[1, context]``). Times are ``time.monotonic()``: CLOCK_MONOTONIC, one
clock for every process on a host, so the steps of workers sharing a host line up (which steps
ran while another worker was stepping is what co-activity is measured from).

A step launched while the one before still runs (overlapped decode) is recorded from when that
one's result was read (the device was busy until then at least) to when its own was.

Turned on per deployment with ``pdserve serve --step-log DIR`` (each worker appends to
``DIR/<worker_id>.jsonl``); off by default. A line costs a few microseconds against steps of
milliseconds.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, Protocol, TypeVar

from pdserve.model_runtime.request import Request
from pdserve.model_runtime.scheduler.plan import ScheduledChunk
from pdserve.steptime.model import is_decode_chunk

Chunks = tuple[tuple[int, int], ...]
R = TypeVar("R", covariant=True)


class Handle(Protocol[R]):
    def result(self) -> R: ...


class Runner(Protocol[R]):
    """``engine.runtime.StepRunner``, restated without torch so this module stays pure."""

    kv_cache: Any

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> R: ...

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> Handle[R]: ...

    def release(self, request_id: str) -> None: ...

    def kept_requests(self) -> int: ...


@dataclass(frozen=True)
class StepRecord:
    start: float  # time.monotonic() seconds
    end: float
    chunks: Chunks  # (new tokens, cached tokens) per request in the step

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def has_prefill(self) -> bool:
        """Any chunk that is not a decode token (as every profile counts them)."""
        return any(not is_decode_chunk(new, cached) for new, cached in self.chunks)

    def to_json(self) -> str:
        return json.dumps({"t0": self.start, "t1": self.end, "chunks": [list(c) for c in self.chunks]})

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        d = json.loads(line)
        if not isinstance(d, dict) or set(d) != {"t0", "t1", "chunks"}:
            raise ValueError(f"not a step record: {line[:80]!r}")
        start, end, chunks = d["t0"], d["t1"], d["chunks"]
        if not all(isinstance(t, (int, float)) for t in (start, end)) or end < start:
            raise ValueError(f"step record times must be numbers with t1 >= t0: {line[:80]!r}")

        def pair(c: object) -> bool:
            return isinstance(c, list) and len(c) == 2 and all(isinstance(x, int) and x >= 0 for x in c)

        if not isinstance(chunks, list) or not all(pair(c) for c in chunks):
            raise ValueError(f"step record chunks must be [[new, cached], ...]: {line[:80]!r}")
        return cls(float(start), float(end), tuple((c[0], c[1]) for c in chunks))


def read_steps(path: Path, since: float = float("-inf"), until: float = float("inf")) -> list[StepRecord]:
    """The steps of one worker's log that started in ``[since, until)``, in order; a missing
    file is no steps (the worker ran none)."""
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = StepRecord.from_json(line)
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        if since <= rec.start < until:
            out.append(rec)
    return out


def read_dir(step_dir: Path) -> dict[str, list[StepRecord]]:
    """Every worker's log in a ``--step-log`` directory: worker id -> its steps in order."""
    return {p.stem: read_steps(p) for p in sorted(step_dir.glob("*.jsonl"))}


class StepLog:
    """Appends step records to a file; safe to call from any thread."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._file: IO[str] | None = path.open("a", buffering=1)  # line-buffered: readable live

    def record(self, rec: StepRecord) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(rec.to_json() + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class LoggedRunner(Generic[R]):
    """A step runner that records each step it runs in a ``StepLog`` (any runner: the model's,
    the emulated one, the zero one)."""

    def __init__(self, inner: Runner[R], log: StepLog, clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.log = log
        self.clock = clock
        self.kv_cache = inner.kv_cache
        self.last_end = float("-inf")  # when the last launched step's result was read

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> R:
        if not chunks:
            return self.inner.execute(chunks, requests, on_layer)
        start = self.clock()
        result = self.inner.execute(chunks, requests, on_layer)
        shape = tuple((c.num_tokens, c.start_pos) for c in chunks)
        self.log.record(StepRecord(start, self.clock(), shape))
        return result

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> _LoggedStep[R]:
        return _LoggedStep(self, self.inner.launch(chunks, requests), chunks, self.clock())

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def kept_requests(self) -> int:
        return self.inner.kept_requests()


class _LoggedStep(Generic[R]):
    def __init__(
        self, owner: LoggedRunner[R], inner: Handle[R], chunks: Sequence[ScheduledChunk], launched: float
    ) -> None:
        self.owner, self.inner, self.chunks, self.launched = owner, inner, chunks, launched

    def result(self) -> R:
        result = self.inner.result()
        end = self.owner.clock()
        if self.chunks:
            start = max(self.launched, self.owner.last_end)
            shape = tuple((c.num_tokens, c.start_pos) for c in self.chunks)
            self.owner.log.record(StepRecord(start, end, shape))
        self.owner.last_end = end
        return result
