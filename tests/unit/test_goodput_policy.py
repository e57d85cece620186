"""The goodput dispatcher on synthetic worker states (no Ray, no servers)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.dispatchers import make_dispatcher
from pdserve.router.goodput import GoodputConfig, GoodputPolicy
from pdserve.router.policy import BEST_EFFORT_PRIORITY, LOAD_POLICIES, Outcome, PairPolicy, RouteRequest
from pdserve.router.predictor import Phase, StepPredictor, inbound
from pdserve.router.prefix import block_keys
from pdserve.router.slo import Admission, SloClass
from pdserve.steptime.roofline import H100_LLAMA3_8B
from pdserve.worker.messages import KvEvents, WorkerLoad, WorkerRole

CHAT = SloClass("chat", ttft_ms=250, tpot_ms=100)
BS = 16


def load(wid: str, role: WorkerRole, free: int = 100_000) -> WorkerLoad:
    return WorkerLoad(wid, role, "", 0, 0, 100_000, free, 0)


P = [load("p0", WorkerRole.PREFILL), load("p1", WorkerRole.PREFILL)]
D = [load("d0", WorkerRole.DECODE), load("d1", WorkerRole.DECODE)]


def policy(local: bool = True) -> GoodputPolicy:
    return GoodputPolicy(StepPredictor(H100_LLAMA3_8B), GoodputConfig(BS, local_prefill=local))


def req(
    rid: str, n: int = 2048, m: int = 64, slo: SloClass = CHAT, prompt: list[int] | None = None
) -> RouteRequest:
    keys = block_keys(prompt, BS) if prompt is not None else ()
    return RouteRequest(n, m, request_id=rid, slo=slo, block_keys=keys)


def fill_prefill(pol: GoodputPolicy, worker: str, count: int, tokens: int = 4096) -> None:
    """Queue ``count`` prefills on ``worker`` (as if placed earlier and still running)."""
    q = pol.ledger.prefill_queue(worker)
    for i in range(count):
        q.add(f"old-{worker}-{i}", pol.model.prefill_s(worker, tokens), now=0.0)


def test_picks_the_pair_that_meets_the_slo_where_round_robin_would_not() -> None:
    pol = policy(local=False)
    fill_prefill(pol, "p0", 8)  # ≈ 8 × 0.1 s of queued prefill: TTFT 250 ms is out of reach
    d = pol.decide(req("r"), P, D, now=0.0)
    assert d.prefill_worker == "p1" and d.outcome is Outcome.REMOTE_PREFILL
    assert d.predicted_ttft_s <= 0.25
    rr = PairPolicy(LOAD_POLICIES["round_robin"]).decide(req("r"), P, D, now=0.0)
    assert rr.prefill_worker == "p0"  # round-robin sends it into the queue


@pytest.mark.parametrize("admission", list(Admission))
def test_admission_when_nothing_fits(admission: Admission) -> None:
    pol = policy()
    for w in ("p0", "p1", "d0", "d1"):
        fill_prefill(pol, w, 10)
    slo = SloClass("strict", ttft_ms=250, tpot_ms=100, admission=admission)
    d = pol.decide(req("r", slo=slo), P, D, now=0.0)
    if admission is Admission.REJECT:
        assert d.outcome is Outcome.REJECTED and d.reason == "ttft"
        assert 0.1 <= d.retry_after_s <= 30 and d.predicted_ttft_s > 0.25
        assert "r" not in pol.ledger  # nothing placed
    elif admission is Admission.BEST_EFFORT:
        assert d.outcome is Outcome.BEST_EFFORT and d.priority == BEST_EFFORT_PRIORITY
        assert "r" in pol.ledger
    else:
        assert d.outcome in (Outcome.REMOTE_PREFILL, Outcome.LOCAL_PREFILL) and d.priority == 0


def test_a_request_without_targets_is_never_rejected() -> None:
    pol = policy()
    for w in ("p0", "p1", "d0", "d1"):
        fill_prefill(pol, w, 10)
    d = pol.decide(req("r", slo=SloClass("none", admission=Admission.REJECT)), P, D, now=0.0)
    assert d.outcome is not Outcome.REJECTED


def test_prefers_the_prefill_worker_holding_the_prefix() -> None:
    pol = policy(local=False)
    shared = list(range(1024))
    pol.on_kv_events("p1", KvEvents(tuple((True, k) for k in block_keys(shared, BS))))  # p1 cached it
    d = pol.decide(req("r", n=1100, prompt=[*shared, *range(5000, 5076)]), P, D, now=0.0)
    assert d.prefill_worker == "p1" and d.reason == "prefix"
    assert d.predicted_ttft_s < pol.model.prefill_s("p0", 1100)  # 1,024 cached tokens are skipped


def test_local_prefill_for_short_prompts_remote_for_long_ones() -> None:
    pol = policy()
    short = pol.decide(req("s", n=64), P, D, now=0.0)
    assert short.prefill_worker is None and short.outcome is Outcome.LOCAL_PREFILL
    assert short.reason == "short_prompt"
    pol.on_end("s", 0.0, None)
    long = pol.decide(req("l", n=4096), P, D, now=0.0)
    assert long.prefill_worker is not None and long.outcome is Outcome.REMOTE_PREFILL


def test_a_slow_link_makes_a_long_prompt_local() -> None:
    pol = policy()
    # d0's transport measured its inbound KV 200x slower than the profile's link (0.5 GB/s)
    pol.model.observe(inbound("d0"), Phase.TRANSFER, 200.0, 1.0)
    d = pol.decide(req("l", n=2048, slo=SloClass("x", ttft_ms=1000, tpot_ms=30)), P, D[:1], now=0.0)
    assert d.prefill_worker is None and d.reason == "slow_link"


def test_avoids_the_decode_worker_where_it_would_make_others_miss() -> None:
    pol = policy(local=False)
    # d0 runs 40 requests whose TPOT target sits just above its current step time.
    tight = SloClass("tight", tpot_ms=1000 * pol.model.decode_step_s("d0", 40, 40 * 4048) * 1.001)
    for i in range(40):
        pol.decide(RouteRequest(2048, 4000, request_id=f"old{i}", slo=tight), P, D[:1], now=0.0)
    assert pol.ledger.batch("d0").size == 40
    d = pol.decide(req("new", n=2048, m=4000, slo=SloClass("loose", tpot_ms=200)), P, D, now=0.0)
    assert d.decode_worker == "d1"


def test_colocated_pool_is_all_local() -> None:
    pol = policy()
    d = pol.decide(req("r"), [], [load("c0", WorkerRole.COLOCATED)], now=0.0)
    assert d.prefill_worker is None and d.reason == "colocated"


def test_online_correction_and_prediction_errors() -> None:
    errors: list[tuple[str, float]] = []
    pol = make_dispatcher("goodput", H100_LLAMA3_8B, BS, local_prefill=False,
                          on_error=lambda k, r: errors.append((k, r)))  # fmt: skip
    assert isinstance(pol, GoodputPolicy)
    d = pol.decide(req("r"), P, D, now=0.0)
    assert d.prefill_worker is not None
    pol.on_first_token("r", 1.0, ttft_s=3 * d.predicted_ttft_s)  # the worker runs 3x slower
    assert pol.model.factor(d.prefill_worker, Phase.PREFILL) == pytest.approx(3.0)
    pol.on_end("r", 2.0, median_itl_s=0.5 * d.predicted_tpot_s)
    assert errors[0] == ("ttft", pytest.approx(3.0)) and errors[1][0] == "tpot"
    other = "p1" if d.prefill_worker == "p0" else "p0"
    assert pol.model.factor(other, Phase.PREFILL) == pytest.approx(3.0)  # peers' prior
    pol.model.observe(other, Phase.PREFILL, 1.0, 1.0)  # ... until it is seen running at speed
    again = pol.decide(req("r2"), P, D, now=3.0)
    assert again.prefill_worker == other  # the slow one is now predicted slow
    pol.on_end("r2", 3.0, None)
    assert len(pol.ledger) == 0


@pytest.mark.parametrize("slow", [0.25, 4.0])
def test_the_correction_converges_to_the_true_ratio(slow: float) -> None:
    """Workers at their profile's speed for ten requests, then ``slow`` times it: a few dozen
    requests later the prefill factor is ``slow`` (the moving average, not the first sample's
    replacement, gets there) and the corrected TTFT matches what is observed (a factor learned
    against its own corrected prediction settles at the square root of the ratio)."""
    pol = policy(local=False)
    n, m = 2048, 64  # ``req``'s; alone in its batch, decode's step is at the prompt + m / 2
    step = H100_LLAMA3_8B.decode_time(1, n + m // 2)
    for i in range(70):
        if i == 10:
            assert pol.model.factor("p0", Phase.PREFILL) == pytest.approx(1.0)
        speed = 1.0 if i < 10 else slow
        d = pol.decide(req(f"r{i}"), P[:1], D[:1], now=float(i))
        assert d.prefill_worker == "p0" and d.decode_worker == "d0"
        # what the workers really take: ``slow`` times the profile (an idle worker: the TTFT
        # predicted is its compute alone, scaled by the factor then in effect)
        f_p = pol.model.factor("p0", Phase.PREFILL)
        pol.on_first_token(f"r{i}", float(i), ttft_s=speed * d.predicted_ttft_s / f_p)
        pol.on_end(f"r{i}", float(i), median_itl_s=speed * step)
    assert pol.model.factor("p0", Phase.PREFILL) == pytest.approx(slow, rel=1e-3)
    # decode keeps the damped update on purpose (``GoodputPolicy.on_end``): the square root
    assert pol.model.factor("d0", Phase.DECODE) == pytest.approx(math.sqrt(slow), rel=1e-3)
    assert len(pol.ledger) == 0


def test_ledger_forgets_a_lost_worker_and_ends_empty() -> None:
    pol = policy(local=False)
    placed = [pol.decide(req(f"r{i}"), P, D, now=0.0) for i in range(6)]
    pol.on_worker_lost("d0")
    for i, d in enumerate(placed):
        if d.decode_worker != "d0":
            pol.on_first_token(f"r{i}", 1.0, 0.1)
            pol.on_end(f"r{i}", 2.0, 0.01)
    assert len(pol.ledger) == 0
    assert all(len(q) == 0 for q in pol.ledger.prefills.values())
    assert all(b.size == 0 for b in pol.ledger.decodes.values())
    assert all(math.isclose(q.total_s, 0.0) for q in pol.ledger.prefills.values())


def test_unknown_policy_name() -> None:
    with pytest.raises(ValueError, match="goodput"):
        make_dispatcher("fastest")


def test_spreads_load_when_every_option_meets_the_slo() -> None:
    pol = policy(local=False)
    placed = [pol.decide(req(f"r{i}", m=256), P, D, now=0.0) for i in range(8)]
    assert sorted(d.decode_worker for d in placed).count("d0") == 4
    assert {d.prefill_worker for d in placed} == {"p0", "p1"}


def test_an_unobserved_worker_starts_from_its_peers_correction() -> None:
    m = StepPredictor(H100_LLAMA3_8B)
    m.observe("p0", Phase.PREFILL, 2.0, 0.002)  # a CPU run of a GPU profile: 1000x slower
    assert m.factor("p0", Phase.PREFILL) == pytest.approx(1000)
    assert m.factor("p1", Phase.PREFILL) == pytest.approx(1000)  # p1 not seen yet: peers' mean
    m.observe("p1", Phase.PREFILL, 1.0, 0.002)
    assert m.factor("p2", Phase.PREFILL) == pytest.approx(750)
    m.forget("p0")
    assert m.factor("p2", Phase.PREFILL) == pytest.approx(500)
    m.observe(inbound("d0"), Phase.TRANSFER, 4.0, 1.0)
    assert m.factor(inbound("d1"), Phase.TRANSFER) == pytest.approx(4.0)
    m.forget("d0")  # its inbound link goes with it, and stops being the peers' prior
    assert m.factor(inbound("d1"), Phase.TRANSFER) == 1.0
    assert m.factor("d0", Phase.DECODE) == 1.0


@pytest.mark.parametrize("n", [16, 64, 512, 4096])
def test_without_targets_prompts_go_to_prefill_workers(n: int) -> None:
    """No SLO class: nothing prices the stall a local prefill puts into d's streams, so with
    prefill workers up no prompt is prefilled on a decode worker, even while they queue."""
    pol = policy()
    fill_prefill(pol, "p0", 4)
    fill_prefill(pol, "p1", 4)
    none = SloClass("default")
    for i in range(8):
        d = pol.decide(req(f"r{i}", n=n, slo=none), P, D, now=0.0)
        assert d.prefill_worker is not None and d.outcome is Outcome.REMOTE_PREFILL
    # With no prefill worker left, decode workers prefill themselves.
    d = pol.decide(req("alone", n=n, slo=none), [], D, now=0.0)
    assert d.prefill_worker is None


def every_option(
    pol: GoodputPolicy, request: RouteRequest, prefill: list[WorkerLoad], decode: list[WorkerLoad], now: float
) -> dict[tuple[str | None, str], tuple[float, ...]]:
    """The key of every (prefill, decode) pair and local option (prefill None), as ``decide``
    ranks them, by pricing each."""
    slo = request.slo or SloClass("default")
    ttft_slo = slo.ttft_ms / 1000 if slo.ttft_ms else math.inf
    tpot_slo = slo.tpot_ms / 1000 if slo.tpot_ms else math.inf
    for w in (*prefill, *decode):
        pol.prefix.set_capacity(w.worker_id, w.kv_total)
    remote = pol._prefill_candidates(request, prefill, now)
    keys: dict[tuple[str | None, str], tuple[float, ...]] = {}
    for d in decode:
        batch = pol._decode_view(d, now)
        steps = pol._tpot_on(d.worker_id, batch, request, now, 0.0)
        room = pol._room_wait(d, batch, steps[1])
        for r in remote:
            keys[(r[0], d.worker_id)] = pol._remote(
                request, d, batch, steps, room, *r, ttft_slo, tpot_slo
            ).key()
        if not prefill or (
            pol.config.local_prefill and (tpot_slo < math.inf or batch.tightest_slo() < math.inf)
        ):
            keys[(None, d.worker_id)] = pol._local(request, d, batch, now, ttft_slo, tpot_slo).key()
    return keys


@settings(max_examples=60, deadline=None)
@given(
    queues=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    batches=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    prompt=st.integers(16, 6000),
    output=st.integers(1, 800),
    ttft=st.sampled_from([0, 100, 250, 2000]),
    tpot=st.sampled_from([0, 20, 100]),
    local=st.booleans(),
    shared=st.booleans(),
)
def test_pricing_each_decode_worker_with_one_prefill_keeps_the_best_option(
    queues: list[int], batches: list[int], prompt: int, output: int, ttft: int, tpot: int, local: bool,
    shared: bool,
) -> None:  # fmt: skip
    """``decide`` prices every decode worker with the one prefill candidate that is best for
    all of them: the option it takes ranks with the best of every pair (equal keys aside)."""
    pol = GoodputPolicy(StepPredictor(H100_LLAMA3_8B), GoodputConfig(BS, local_prefill=local,
                                                                     prefill_step_tokens=8192))  # fmt: skip
    pre = [load(f"p{i}", WorkerRole.PREFILL) for i in range(len(queues))]
    dec = [load(f"d{i}", WorkerRole.DECODE) for i in range(len(batches))]
    for i, count in enumerate(queues):
        fill_prefill(pol, f"p{i}", count, tokens=1000 + 500 * i)
    tokens = list(range(prompt))
    n = 0
    for i, size in enumerate(batches):  # decode batches of different sizes; a prefix cached somewhere
        for _ in range(size):
            old = req(f"old{n}", n=prompt, m=300, prompt=tokens if shared else None)
            pol.decide(old, pre, dec[i : i + 1], now=0.0)
            n += 1
    slo = SloClass("c", ttft_ms=ttft, tpot_ms=tpot)
    r = req("new", n=prompt, m=output, slo=slo, prompt=tokens if shared else None)
    keys = every_option(pol, r, pre, dec, now=0.5)
    d = pol.decide(r, pre, dec, now=0.5)
    assert keys[(d.prefill_worker, d.decode_worker)] == max(keys.values())
