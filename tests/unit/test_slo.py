"""SLO classes, the live attainment window, the router's ledger and prefix index (pure)."""

from __future__ import annotations

import math

import pytest

from pdserve.router.ledger import DecodeBatch, DecodeEntry, Ledger, PrefillQueue
from pdserve.router.prefix import block_keys
from pdserve.router.slo import Admission, SloBook, SloClass, SloResult, SloTracker


def test_slo_class_parse_and_errors() -> None:
    c = SloClass.parse("chat:ttft=250,tpot=100,admission=reject")
    assert c == SloClass("chat", 250.0, 100.0, Admission.REJECT)
    assert SloClass.parse("batch:tpot=500").admission is Admission.NONE
    assert c.met(250, 100.5) == (True, False)
    assert SloClass("free").met(1e9, 1e9) == (True, True)
    bad_specs = ("chat:ttft", "chat:ttft=abc", "chat:speed=3", ":ttft=3", "x:admission=maybe", "x:ttft=-1",
                 "x:ttft=nan", "x:tpot=NaN", "x:tpot=inf", "x:ttft=-inf")  # fmt: skip
    for bad in bad_specs:
        with pytest.raises(ValueError):
            SloClass.parse(bad)
    # a request's own targets (gRPC floats may carry them) are held to the same rule
    book = SloBook.of(c)
    assert book.resolve("chat", ttft_ms=1e-40).ttft_ms == 1e-40  # absurd, but a target nothing meets
    for ttft, tpot in ((math.nan, 0.0), (0.0, math.inf), (math.inf, math.nan)):
        with pytest.raises(ValueError, match="finite"):
            book.resolve("chat", ttft_ms=ttft, tpot_ms=tpot)


def test_book_resolves_classes_and_request_overrides() -> None:
    book = SloBook.of(SloClass("chat", 250, 100, Admission.REJECT), SloClass("batch", 5000, 500))
    assert book.resolve().name == "chat"
    assert book.resolve("batch").tpot_ms == 500
    own = book.resolve("", ttft_ms=100)
    assert (own.ttft_ms, own.tpot_ms, own.admission) == (100, 100, Admission.REJECT)
    with pytest.raises(ValueError, match="unknown SLO class"):
        book.resolve("gold")
    assert book.thresholds_s() == ([0.25, 5.0], [0.1, 0.5])
    assert SloBook.of().resolve().empty
    with pytest.raises(ValueError):
        SloBook.of(SloClass("a"), default="b")


def result(t: float, cls: str = "chat", good: bool = True, ok: bool = True) -> SloResult:
    return SloResult(t, cls, 100.0 if good else 900.0, 10.0, good, True, ok)


def test_tracker_windows_series_and_horizon() -> None:
    tr = SloTracker(horizon_s=100)
    for i in range(10):
        tr.record(result(float(i), good=i % 2 == 0))
    tr.record(result(9.5, cls="batch", ok=False))
    w = tr.window(now=10.0, span_s=11.0)  # (-1, 10]: all of them
    assert (w.requests, w.good) == (11, 5) and w.goodput_rps == pytest.approx(5 / 11)
    assert w.attainment == pytest.approx(5 / 11)
    assert w.ttft_p50_ms == 100.0 and w.ttft_p99_ms == 900.0  # failed requests have no latency
    chat = tr.window(now=10.0, span_s=11.0, slo_class="chat")
    assert chat.requests == 10 and chat.attainment == pytest.approx(0.5)
    assert tr.window(now=10.0, span_s=10.0).requests == 10  # (0, 10]: t=0 is out
    assert math.isnan(tr.window(now=100.0, span_s=5.0).attainment)
    series = tr.series(now=10.0, horizon_s=10.0, step_s=5.0)
    assert [s.requests for s in series] == [5, 5]  # (0, 5] and (5, 10]
    tr.record(result(200.0))  # beyond the horizon: the old ones are dropped
    assert tr.window(now=200.0, span_s=1000.0).requests == 1
    assert tr.classes() == ["chat"]


def test_prefill_queue_predicts_the_wait() -> None:
    q = PrefillQueue()
    assert q.wait_s(0.0) == 0.0
    q.add("a", 1.0, now=0.0)
    q.add("b", 2.0, now=0.5)
    assert q.wait_s(0.5) == pytest.approx(2.5)  # a has 0.5 s left, then b's 2 s
    q.done("a", now=1.2)
    assert q.wait_s(1.2) == pytest.approx(2.0)
    q.discard("b")
    assert q.wait_s(1.2) == 0.0 and len(q) == 0


def test_decode_batch_counts_misses_and_prefill_share() -> None:
    b = DecodeBatch()
    for i, slo in enumerate((0.010, 0.020, 0.030, math.inf)):
        b.add(f"r{i}", DecodeEntry(100, 10, slo))
    assert b.size == 4 and b.context == 400 and b.tightest_slo() == 0.010
    assert b.misses_between(0.005, 0.025) == 2
    assert b.misses_between(0.025, 0.005) == 0
    b.remove("r0")
    assert b.tightest_slo() == 0.020 and b.misses_between(0.005, 0.025) == 1
    b.add_local_prefill(0.0, 0.2)
    b.add_local_prefill(1.0, 0.2)
    assert b.prefill_share(1.5, window_s=2.0) == pytest.approx(0.2)
    assert b.prefill_share(2.5, window_s=2.0) == pytest.approx(0.1)
    assert b.prefill_share(10.0, window_s=2.0) == 0.0


def test_ledger_moves_requests_through_their_life() -> None:
    led = Ledger()
    led.add("r", "p0", 0.1, "d0", DecodeEntry(100, 10, 0.05), now=0.0)
    assert "r" in led and len(led.prefill_queue("p0")) == 1 and led.batch("d0").size == 1
    led.prefill_done("r", 0.1)
    assert len(led.prefill_queue("p0")) == 0 and led.batch("d0").size == 1
    led.decode_done("r", 1.0)
    assert len(led) == 0 and led.batch("d0").size == 0
    led.add("s", "p0", 0.1, "d0", DecodeEntry(100, 10, 0.05), now=2.0)
    led.drop_worker("d0")
    assert len(led) == 0 and len(led.prefill_queue("p0")) == 0


def test_block_keys_chain() -> None:
    a = block_keys(list(range(40)), 16)
    b = block_keys([*range(32), 99, 98], 16)
    assert len(a) == 2 and a == b[:2]  # same 32-token prefix; partial blocks never count
    assert block_keys([*range(16, 32), *range(16)], 16)[1] != a[1]  # keys chain: order matters


def test_the_routers_block_keys_are_the_workers_prefix_cache_keys() -> None:
    """One key function: what the router records per worker is what that worker's prefix cache
    looks up, so a predicted hit is a real one."""
    from pdserve.model_runtime.kv_cache.manager import KVCacheManager
    from pdserve.model_runtime.request import Request
    from pdserve.model_runtime.sampling_params import SamplingParams

    tokens = tuple(range(3, 3 + 16 * 3 + 5))
    kv = KVCacheManager(16, block_size=16)
    req = Request("r", tokens, SamplingParams(max_tokens=1), ())
    keys = kv._request_keys(req, 3)
    assert block_keys(tokens, 16) == tuple(keys) and len(keys) == 3


def test_tails_are_the_windows_own_numbers_in_seconds() -> None:
    t = SloTracker()
    t.record(SloResult(50.0, "chat", 999.0, 999.0, True, True, True))  # before the window
    for i in range(10):  # 10 ended in the window, the first two failed, one more missed TPOT
        ok = i >= 2
        t.record(SloResult(100.0 + i, "chat", 10.0 * (i + 1), 5.0 + i, True, i != 5, ok))
    n, attainment, ttft_q, tpot_p50 = t.tails(110.0, 20.0, 0.9)
    w = t.window(110.0, 20.0)
    assert n == w.requests == 10 and attainment == w.attainment == 0.7
    assert ttft_q == 0.1  # the nearest-rank 0.9 quantile of the 8 finished ones, 30..100 ms
    assert tpot_p50 == w.tpot_p50_ms / 1000
    # only what arrived at 103 or later (arrival defaults to the end: a refusal's)
    t.record(SloResult(109.5, "chat", 10.0, 5.0, True, True, True, arrival=100.0))
    since = t.tails(110.0, 20.0, 0.9, since=103.0)
    assert since[0] == 7 and since[1] == pytest.approx(6 / 7)  # 103..109 (105 missed TPOT)
    assert t.tails(110.0, 20.0, 0.9)[0] == 11
    empty = t.tails(1000.0, 10.0, 0.9)
    assert empty[0] == 0 and all(math.isnan(x) for x in empty[1:])
