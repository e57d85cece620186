"""Requests waiting for their grammar: ``GrammarGate`` alone (a fake compiler the test makes
ready), then in the decode and prefill engines on the ``tiny`` model (its real grammars, whose
readiness the test holds back), where a request that waits and leaves must leave nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.kvtransfer.states import Completions
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.engine.runtime import Runtime, build_runtime
from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.model_runtime.structured.compiler import Grammars
from pdserve.model_runtime.structured.constraint import Constraint, ConstraintKind
from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.worker.grammar_gate import GrammarGate
from pdserve.worker.messages import TokenDelta, WorkerRole, WorkItem

CHOICE = Constraint.choice(["yes", "no"])
OTHER = Constraint(ConstraintKind.REGEX, "[0-9]+")

# -- the gate alone ---------------------------------------------------------------------------


@dataclass
class FakeCompiles:
    """Constraints become ready when the test says; a refused one raises from ``accepts`` (as
    ``Grammars.compiled`` does); the tokens any constraint accepts are ``good``."""

    ready_: set[Constraint] = field(default_factory=set)
    refused: set[Constraint] = field(default_factory=set)
    good: frozenset[int] = frozenset(range(10))
    loads: int = 0

    def load(self) -> None:
        self.loads += 1

    def ready(self, c: Constraint) -> bool:
        return c in self.ready_

    def accepts(self, c: Constraint, tokens: Sequence[int]) -> bool:
        if c in self.refused:
            raise InvalidRequestError("regex", "does not compile")
        return all(t in self.good for t in tokens)


def request(rid: str, c: Constraint | None, out: Sequence[int] = ()) -> Request:
    return Request(rid, (1, 2), SamplingParams(constraint=c), output_token_ids=list(out))


Gate = tuple[GrammarGate, FakeCompiles, list[str]]


@pytest.fixture
def gate() -> Gate:
    fake = FakeCompiles()
    return GrammarGate(fake), fake, []


def test_ready_or_unconstrained_runs_at_once(gate: Gate) -> None:
    g, fake, ran = gate
    g.hold(request("free", None), lambda: ran.append("free"))
    fake.ready_.add(CHOICE)
    g.hold(request("r", CHOICE, [1, 2]), lambda: ran.append("r"))
    assert ran == ["free", "r"] and len(g) == 0 and g.poll() == []


def test_held_until_ready_then_poll_releases(gate: Gate) -> None:
    g, fake, ran = gate
    g.hold(request("a", CHOICE), lambda: ran.append("a"))
    g.hold(request("b", OTHER), lambda: ran.append("b"))
    assert ran == [] and len(g) == 2 and "a" in g and "b" in g and bool(g)
    assert g.poll() == [] and ran == []
    fake.ready_.add(OTHER)
    assert g.poll() == [] and ran == ["b"] and "b" not in g and len(g) == 1
    fake.ready_.add(CHOICE)
    assert g.poll() == [] and ran == ["b", "a"] and len(g) == 0
    assert g.poll() == [] and ran == ["b", "a"]  # released once
    assert fake.loads == 2  # on the engine's thread, at each hold (cheap after the first)


def test_refusals(gate: Gate) -> None:
    g, fake, ran = gate
    held = request("late", CHOICE)
    g.hold(held, lambda: ran.append("late"))
    fake.refused.add(CHOICE)
    fake.ready_.add(CHOICE)
    (failed,) = g.poll()
    assert failed[0] is held and "does not compile" in failed[1]
    assert ran == [] and len(g) == 0
    with pytest.raises(InvalidRequestError, match="does not compile"):  # refused already: at once
        g.hold(request("now", CHOICE), lambda: ran.append("now"))
    assert ran == [] and len(g) == 0


def test_replayed_tokens_outside_the_constraint_are_refused(gate: Gate) -> None:
    g, fake, ran = gate
    fake.ready_.add(CHOICE)
    with pytest.raises(InvalidRequestError) as e:
        g.hold(request("now", CHOICE, [1, 99]), lambda: ran.append("now"))
    assert e.value.field == "output_token_ids"
    fake.ready_.clear()
    bad = request("later", CHOICE, [99])
    g.hold(bad, lambda: ran.append("later"))
    fake.ready_.add(CHOICE)
    assert [(r.request_id, why.split(":")[0]) for r, why in g.poll()] == [("later", "output_token_ids")]
    assert ran == [] and len(g) == 0


def test_drop_forgets(gate: Gate) -> None:
    g, fake, ran = gate
    g.hold(request("a", CHOICE), lambda: ran.append("a"))
    assert g.drop("a") and not g.drop("a") and not g.drop("never")
    assert len(g) == 0 and "a" not in g
    fake.ready_.add(CHOICE)
    assert g.poll() == [] and ran == []


def test_a_worker_without_grammars_refuses_constraints() -> None:
    g = GrammarGate(None)
    ran: list[str] = []
    g.hold(request("free", None), lambda: ran.append("free"))
    g.prepare(None)
    with pytest.raises(InvalidRequestError, match="cannot constrain"):
        g.prepare(CHOICE)
    with pytest.raises(InvalidRequestError, match="cannot constrain"):
        g.hold(request("r", CHOICE), lambda: ran.append("r"))
    assert ran == ["free"] and g.poll() == []


# -- the engines ------------------------------------------------------------------------------


@dataclass
class HeldBack:
    """The runtime's grammars, not ready while ``open`` is False (a compile still running)."""

    inner: Grammars
    open: bool = False

    def load(self) -> None:
        self.inner.load()

    def ready(self, c: Constraint) -> bool:
        return self.open and self.inner.ready(c)

    def accepts(self, c: Constraint, tokens: Sequence[int]) -> bool:
        return self.inner.accepts(c, tokens)


@pytest.fixture(scope="module")
def tiny() -> Iterator[Runtime]:
    rt = build_runtime(
        EngineConfig(
            model="tiny",
            device="cpu",
            cache=CacheConfig(block_size=8, num_blocks=32),
            scheduler=SchedulerConfig(64, 4),
        )
    )
    assert rt.grammars is not None
    for c in (CHOICE, OTHER):
        rt.grammars.check(c)
    yield rt
    rt.close()


@pytest.fixture
def held(tiny: Runtime) -> tuple[Runtime, HeldBack]:
    assert tiny.grammars is not None
    hb = HeldBack(tiny.grammars)
    return dataclasses.replace(tiny, grammars=hb), hb  # type: ignore[arg-type]


def decode_engine(rt: Runtime) -> DecodeEngine:
    return DecodeEngine(rt, None, rt.config.scheduler, "w", WorkerRole.COLOCATED)


def work(rid: str, c: Constraint | None = CHOICE, out: Sequence[int] = (), max_tokens: int = 8) -> WorkItem:
    return WorkItem(
        rid, (5, 6, 7), SamplingParams(max_tokens=max_tokens, constraint=c), output_token_ids=tuple(out)
    )


def clean(eng: DecodeEngine | PrefillEngine) -> None:
    assert eng.idle
    assert all(v == 0 for v in eng.request_state().values()), eng.request_state()
    eng.check_integrity()


def run(eng: DecodeEngine) -> dict[str, TokenDelta]:
    last: dict[str, TokenDelta] = {}
    out: dict[str, list[int]] = {}
    for _ in range(50):
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
            last[d.request_id] = dataclasses.replace(d, token_ids=tuple(out[d.request_id]))
        if not eng.has_work and not eng.has_pending_io:
            break
    return last


def test_decode_abort_while_compiling_leaves_nothing(held: tuple[Runtime, HeldBack]) -> None:
    rt, hb = held
    eng = decode_engine(rt)
    eng.add_local(work("r"))
    eng.add_local(work("s", out=b"ye"))
    state = eng.request_state()
    assert (state["grammar_wait"], state["requests"]) == (2, 2)
    assert run(eng) == {}  # nothing runs while the grammar is not ready
    assert eng.abort("r") and not eng.abort("r")
    hb.open = True
    done = run(eng)
    assert list(done) == ["s"] and done["s"].token_ids == (*b"s", 257)
    assert done["s"].error is None and done["s"].finished
    clean(eng)


def test_decode_refuses_replayed_tokens_outside_the_constraint(held: tuple[Runtime, HeldBack]) -> None:
    rt, hb = held
    eng = decode_engine(rt)
    hb.open = True
    with pytest.raises(InvalidRequestError) as e:
        eng.add_local(work("r", out=b"ya"))
    assert e.value.field == "output_token_ids"
    clean(eng)
    eng.add_local(work("r", out=b"y"))  # the id is free again, and a good replay goes on
    assert run(eng)["r"].token_ids == (*b"es", 257)
    clean(eng)
    hb.open = False
    eng.add_local(work("q", out=b"n!"))  # held: checked when its grammar is ready
    hb.open = True
    (d,) = run(eng).values()
    assert d.request_id == "q" and d.error is not None and "output_token_ids" in d.error
    clean(eng)


def test_decode_reports_a_refusal_found_while_waiting(held: tuple[Runtime, HeldBack]) -> None:
    rt, hb = held
    eng = decode_engine(rt)
    bad = Constraint(ConstraintKind.REGEX, "(unclosed")
    eng.add_local(work("r", c=bad))
    assert eng.request_state()["grammar_wait"] == 1
    hb.open = True
    with pytest.raises(InvalidRequestError):
        hb.inner.check(bad)  # the compile's end
    (d,) = run(eng).values()
    assert d.error is not None and "does not compile" in d.error
    clean(eng)


class NoTransfers:
    """A transport that never moves anything (these requests never reach a push)."""

    settling = False

    def poll(self) -> Completions:
        return Completions()


def test_prefill_abort_or_withdraw_while_compiling_leaves_nothing(held: tuple[Runtime, HeldBack]) -> None:
    rt, hb = held
    eng = PrefillEngine(rt, NoTransfers(), rt.config.scheduler, "p")  # type: ignore[arg-type]
    eng.add(work("a"))
    eng.add(work("w"))
    eng.add(work("x", c=OTHER))
    assert eng.request_state()["grammar_wait"] == 3
    assert eng.step() == [] and eng.request_state()["kv_tables"] == 0  # nothing scheduled
    assert eng.abort("a") and eng.withdraw("w")
    assert not eng.abort("a") and not eng.withdraw("w")
    assert eng.request_state()["grammar_wait"] == 1
    hb.open = True
    (d,) = eng.step()
    assert d.request_id == "x" and d.prefilled and chr(d.token_ids[0]).isdigit()
    assert not eng.withdraw("x")  # started: too late to withdraw
    assert eng.abort("x")
    clean(eng)
