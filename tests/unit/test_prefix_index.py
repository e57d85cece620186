"""The router's prefix index: learnt from the workers' events, with short hints for prompts
it just placed."""

from __future__ import annotations

from pdserve.router.goodput import GoodputConfig, GoodputPolicy
from pdserve.router.policy import RouteRequest
from pdserve.router.predictor import StepPredictor
from pdserve.router.prefix import PrefixIndex, block_keys
from pdserve.router.slo import SloClass
from pdserve.steptime.roofline import H100_LLAMA3_8B
from pdserve.worker.messages import KvEvents, WorkerLoad, WorkerRole

BS = 16
PROMPT = block_keys(list(range(64)), BS)  # 4 blocks


def stored(*keys: bytes) -> KvEvents:
    return KvEvents(tuple((True, k) for k in keys))


def test_events_build_the_view_a_snapshot_replaces_it() -> None:
    idx = PrefixIndex(BS, hint_s=0.0)
    idx.apply("p0", stored(*PROMPT))
    assert idx.cached_blocks("p0", PROMPT, now=0.0) == 4 and idx.cached_blocks("p1", PROMPT, now=0.0) == 0
    idx.apply("p0", KvEvents(((False, PROMPT[2]), (True, PROMPT[2]), (False, PROMPT[1]))))  # in order
    assert idx.cached_blocks("p0", PROMPT, now=0.0) == 1  # a hole at block 1 ends the prefix
    assert idx.holds("p0") == {PROMPT[0], PROMPT[2], PROMPT[3]}
    idx.apply("p0", KvEvents(((True, PROMPT[1]),), snapshot=(PROMPT[3],)))  # snapshot first, then ops
    assert idx.holds("p0") == {PROMPT[1], PROMPT[3]}
    idx.forget("p0")
    assert idx.holds("p0") == frozenset()


def test_a_view_never_holds_more_keys_than_the_worker_has_blocks() -> None:
    idx = PrefixIndex(BS, hint_s=0.0)
    idx.set_capacity("p0", 3)
    idx.apply("p0", stored(*PROMPT))
    assert len(idx.holds("p0")) == 3  # a fourth key cannot be cached there: ignored
    idx.apply("p0", KvEvents((), snapshot=PROMPT))
    assert idx.holds("p0") == set(PROMPT[1:])  # the newest of a snapshot too large


def test_a_hint_counts_until_the_worker_reports_the_keys_or_it_expires() -> None:
    idx = PrefixIndex(BS, hint_s=2.0)
    idx.record("p0", PROMPT, now=10.0)
    assert idx.cached_blocks("p0", PROMPT, now=11.9) == 4
    assert idx.cached_blocks("p0", PROMPT, now=12.0) == 0  # expired: the worker never said so
    assert idx.holds("p0") == frozenset()  # hints are never the worker's view
    idx.record("p0", PROMPT, now=20.0)
    idx.apply("p0", stored(*PROMPT[:2]))  # the worker cached the first two: their hints end
    idx.apply("p0", KvEvents(((False, PROMPT[0]),)))  # ... and evicted one: gone, hint or not
    assert idx.cached_blocks("p0", PROMPT, now=20.5) == 0
    assert idx.cached_blocks("p0", PROMPT[1:], now=20.5) == 3  # held, then two hints still on
    assert idx.cached_blocks("p0", PROMPT[1:], now=22.0) == 1


def test_hints_are_bounded_by_the_workers_blocks_and_off_at_zero() -> None:
    idx = PrefixIndex(BS, hint_s=2.0)
    idx.set_capacity("p0", 2)
    idx.record("p0", PROMPT, now=0.0)
    assert len(idx._hints["p0"]) == 2
    off = PrefixIndex(BS, hint_s=0.0)
    off.record("p0", PROMPT, now=0.0)
    assert off.cached_blocks("p0", PROMPT, now=0.0) == 0


def test_a_burst_sharing_a_prefix_follows_the_first_to_its_worker_before_any_event() -> None:
    """Prompts with one long prefix arriving together: the first one's worker has cached
    nothing yet, but the router's hint sends the rest after it; once the hint is over and the
    worker never reported the keys, the prefix weighs nothing."""
    pol = GoodputPolicy(StepPredictor(H100_LLAMA3_8B), GoodputConfig(BS, local_prefill=False))
    roles = (("p0", WorkerRole.PREFILL), ("p1", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE))
    loads = [WorkerLoad(w, r, "", 0, 0, 100_000, 100_000, 0) for w, r in roles]
    shared = list(range(4096))
    none = SloClass("none")

    def request(i: int) -> RouteRequest:
        prompt = [*shared, *range(10_000 * (i + 1), 10_000 * (i + 1) + 64)]
        return RouteRequest(len(prompt), 16, request_id=f"r{i}", slo=none, block_keys=block_keys(prompt, BS))

    first = pol.decide(request(0), loads[:2], loads[2:], now=0.0)
    for i in range(1, 4):
        d = pol.decide(request(i), loads[:2], loads[2:], now=0.01 * i)
        assert d.prefill_worker == first.prefill_worker and d.reason == "prefix"
    late = pol.decide(request(9), loads[:2], loads[2:], now=0.04 + pol.prefix.hint_s)  # after the last hint
    assert late.reason != "prefix"
