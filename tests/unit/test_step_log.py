"""Step logs: what a worker writes per forward step, read back exactly; the runner wrapper
records every non-empty step with the profiles' chunk convention."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pdserve.model_runtime.engine.step_log import LoggedRunner, StepLog, StepRecord, read_steps
from pdserve.model_runtime.scheduler.plan import ScheduledChunk


def test_record_round_trips_and_knows_its_kind() -> None:
    prefill = StepRecord(1.0, 1.25, ((128, 0), (1, 40)))
    decode = StepRecord(2.0, 2.01, ((1, 40), (1, 7)))
    for rec in (prefill, decode):
        assert StepRecord.from_json(rec.to_json()) == rec
    assert prefill.has_prefill and not decode.has_prefill
    assert prefill.duration == pytest.approx(0.25)
    assert StepRecord(0.0, 1.0, ((1, 0),)).has_prefill  # a one-token prompt is prefill, not decode


@pytest.mark.parametrize(
    "line",
    [
        "[]",
        '{"t0": 1, "t1": 2}',
        '{"t0": 2, "t1": 1, "chunks": []}',
        '{"t0": "a", "t1": 1, "chunks": []}',
        '{"t0": 1, "t1": 2, "chunks": [[1]]}',
        '{"t0": 1, "t1": 2, "chunks": [[1, -3]]}',
        '{"t0": 1, "t1": 2, "chunks": [], "extra": 0}',
    ],
)
def test_malformed_records_are_refused(line: str) -> None:
    with pytest.raises(ValueError):
        StepRecord.from_json(line)


def test_read_steps_windows_and_names_the_bad_line(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "sub" / "w.jsonl")
    for t in range(5):
        log.record(StepRecord(float(t), t + 0.5, ((1, 10 + t),)))
    log.close()
    log.record(StepRecord(9.0, 9.5, ()))  # after close: dropped, not an error
    path = tmp_path / "sub" / "w.jsonl"
    assert [r.start for r in read_steps(path)] == [0, 1, 2, 3, 4]
    assert [r.start for r in read_steps(path, since=1, until=3)] == [1, 2]
    assert read_steps(tmp_path / "none.jsonl") == []
    path.write_text(path.read_text() + "not json\n")
    with pytest.raises(ValueError, match=r"w.jsonl:6"):
        read_steps(path)


class FakeRunner:
    kv_cache = None

    def __init__(self) -> None:
        self.released: list[str] = []

    def execute(self, chunks, requests, on_layer=None):  # type: ignore[no-untyped-def]
        if on_layer is not None:
            on_layer(0)
        return {c.request_id: 7 for c in chunks}

    def kept_requests(self) -> int:
        return 0

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def chunk(rid: str, n: int, start: int) -> ScheduledChunk:
    return ScheduledChunk(rid, tuple(range(n)), start, (0,), True)


def test_logged_runner_records_each_step_and_passes_everything_through(tmp_path: Path) -> None:
    ticks = iter([10.0, 10.2, 11.0, 11.01])
    inner = FakeRunner()
    log = StepLog(tmp_path / "w.jsonl")
    runner = LoggedRunner(inner, log, clock=lambda: next(ticks))
    layers: list[int] = []
    assert runner.execute([chunk("a", 100, 0), chunk("b", 1, 33)], {}, layers.append) == {"a": 7, "b": 7}
    assert runner.execute([], {}) == {}  # nothing ran: nothing logged, no clock read
    runner.execute([chunk("b", 1, 34)], {})
    runner.release("a")
    log.close()
    assert layers == [0] and inner.released == ["a"]
    assert read_steps(tmp_path / "w.jsonl") == [
        StepRecord(10.0, 10.2, ((100, 0), (1, 33))),
        StepRecord(11.0, 11.01, ((1, 34),)),
    ]


def test_log_takes_records_from_many_threads(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "w.jsonl")

    def write(k: int) -> None:
        for i in range(200):
            log.record(StepRecord(k * 1000.0 + i, k * 1000.0 + i + 0.5, ((1, i + 1),)))

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    assert len(read_steps(tmp_path / "w.jsonl")) == 800
