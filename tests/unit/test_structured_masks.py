"""The structured-output sampling path: ``GrammarMasks``, ``apply`` and the ``Sampler``.

The oracle is a fresh xgrammar matcher fed a row's tokens: whatever order the rows are masked
in (steps skipped, a token still pending from an overlapped step, a request rewound), the mask
``GrammarMasks`` builds must be the one that matcher gives, a JSON row less every token with a
control byte. The grammars are the worker's (``Grammars``) on the ``tiny`` model's byte
vocabulary (token ``b`` is byte ``b``; 256..258 are special, 257 is EOS).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.sampling.sampler import Sampler, SampleRow
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.structured.compiler import Grammars
from pdserve.model_runtime.structured.constraint import Constraint, ConstraintKind
from pdserve.model_runtime.structured.matchers import GrammarMasks, apply
from tests.unit.tiny_grammars import tiny_grammars

VOCAB = 259
EOS = 257
WORDS = (VOCAB + 31) // 32

REGEX = Constraint(ConstraintKind.REGEX, r"(ab|a[0-9]{1,3})(-[xy]+)?")
CHOICE = Constraint.choice(["red", "green", "grey", "gr"])
SCHEMA = Constraint.json_schema(
    {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "s": {"type": "string", "maxLength": 4},
            "ok": {"type": "boolean"},
        },
        "required": ["n", "s"],
    }
)
SHORT_STRING = Constraint.json_schema({"type": "string", "maxLength": 5})
CONSTRAINTS = (REGEX, CHOICE, SCHEMA, SHORT_STRING)


@pytest.fixture(scope="module")
def grammars() -> Iterator[Grammars]:
    g = tiny_grammars()
    assert (g.vocab_size, g.eos_ids) == (VOCAB, (EOS,))
    for c in CONSTRAINTS:
        g.check(c)
    yield g
    g.close()


_BITS = torch.arange(32, dtype=torch.int32)


def allowed(row: torch.Tensor) -> set[int]:
    """The token ids a bitmask row ([words] int32) allows."""
    bits = (row.unsqueeze(1) >> _BITS) & 1
    return set(bits.flatten()[:VOCAB].nonzero().flatten().tolist())


@functools.cache
def controls(grammars: Grammars) -> frozenset[int]:
    """The tokens holding a control byte, as the grammar engine decodes the vocabulary."""
    vocab = grammars.compiled(REGEX).tokenizer_info.decoded_vocab
    return frozenset(t for t, piece in enumerate(vocab) if any(b < 0x20 for b in piece))


def expected(grammars: Grammars, c: Constraint, tokens: Sequence[int]) -> set[int]:
    """What a fresh matcher fed ``tokens`` allows next (every token once it terminated: the
    rest are computed past the end and dropped); a JSON row never a control byte."""
    m = xgr.GrammarMatcher(grammars.compiled(c))
    for t in tokens:
        if m.is_terminated():
            return set(range(VOCAB))
        assert m.accept_token(t), f"the walk took token {t}, which the grammar refuses"
    if m.is_terminated():
        return set(range(VOCAB))
    bm = xgr.allocate_token_bitmask(1, VOCAB)
    m.fill_next_token_bitmask(bm)
    ok = allowed(bm[0])
    if c.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT):
        ok -= controls(grammars)
    return ok


def sample_row(
    rid: str, c: Constraint | None, out: Sequence[int] = (), pending: int = 0, **params: object
) -> SampleRow:
    p = SamplingParams(constraint=c, **params)  # type: ignore[arg-type]
    # A list is passed as is: a request's output list is one object for its life (the matchers
    # tell a new request under a re-used id by it).
    output = out if isinstance(out, list) else list(out)
    return SampleRow(p, [1, 2, 3], output, frozenset({EOS}), rid, pending)


# -- GrammarMasks: the property -------------------------------------------------------------


@dataclass
class Walker:
    """One request: its constraint, the tokens it will have (a walk of its grammar) and how many
    of them the engine holds now."""

    rid: str
    c: Constraint
    tokens: list[int] = field(default_factory=list)
    shown: int = 0
    out: list[int] = field(default_factory=list)  # its output list, as the engine holds it


def extend(grammars: Grammars, w: Walker, data: st.DataObject, max_len: int) -> None:
    """Walk on from ``w.tokens``: a random allowed token each step until EOS or ``max_len``,
    then perhaps a token or two an overlapped step computes past the end."""
    while len(w.tokens) < max_len:
        ok = expected(grammars, w.c, w.tokens)
        if len(ok) == VOCAB:  # terminated
            break
        w.tokens.append(data.draw(st.sampled_from(sorted(ok))))
    if w.tokens and w.tokens[-1] == EOS:
        w.tokens += data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))


def pending_token(pending: dict[str, int], asked: list[str], rid: str) -> int:
    asked.append(rid)
    return pending[rid]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_masks_equal_a_fresh_matchers_whatever_the_order(grammars: Grammars, data: st.DataObject) -> None:
    masks = GrammarMasks(grammars, [EOS])
    walkers = [Walker(f"r{i}", c) for i, c in enumerate(data.draw(st.permutations(CONSTRAINTS))[:3])]
    for w in walkers:
        extend(grammars, w, data, data.draw(st.integers(1, 14)))
    seen: set[str] = set()
    for _ in range(data.draw(st.integers(1, 12))):
        rows: list[SampleRow] = []
        pending: dict[str, int] = {}
        want: list[tuple[Walker, list[int]]] = []
        for w in walkers:
            op = data.draw(st.sampled_from(["step", "skip", "absent", "rewind", "diverge"]))
            if op == "absent":  # not in this step's batch
                continue
            if op == "step":
                w.shown = min(w.shown + 1, len(w.tokens))
            elif op == "skip":  # several tokens at once (a replay, a migration, a lost step)
                w.shown = min(w.shown + data.draw(st.integers(2, 6)), len(w.tokens))
            elif op == "rewind" and w.shown:  # a preempted request that lost its tail
                w.shown = data.draw(st.integers(0, w.shown - 1))
            elif op == "diverge" and w.shown:  # another output: a new tail from an earlier token
                keep = data.draw(st.integers(0, w.shown - 1))
                old = w.tokens[w.shown - 1]
                w.tokens = w.tokens[:keep]
                extend(grammars, w, data, data.draw(st.integers(keep + 1, keep + 14)))
                if w.shown <= len(w.tokens) and w.tokens[w.shown - 1] == old:
                    # The same token where the accepted part ended: ``_extends`` compares the
                    # count and the last token only (an id is released before it is re-used, a
                    # preempted request keeps its tokens), so show it as a rewind first.
                    w.shown = keep
                else:
                    w.shown = min(w.shown, len(w.tokens))
            tokens = w.tokens[: w.shown]
            in_flight = data.draw(st.booleans())
            if tokens and in_flight:  # the last token is the step in flight's
                pending[w.rid] = tokens[-1]
                w.out[:] = tokens[:-1]
                rows.append(sample_row(w.rid, w.c, w.out, pending=1))
            else:
                w.out[:] = tokens
                rows.append(sample_row(w.rid, w.c, w.out))
            want.append((w, tokens))
            if data.draw(st.booleans()):
                rows.append(sample_row(f"free{len(rows)}", None, [5, 6]))

        asked: list[str] = []
        got = masks.mask(rows, functools.partial(pending_token, pending, asked))
        assert sorted(asked) == sorted(pending)
        if not want:
            assert got is None
            continue
        assert got is not None
        index, bitmask = got
        assert index == [i for i, r in enumerate(rows) if r.params.constraint is not None]
        assert bitmask.shape == (len(want), WORDS) and bitmask.dtype == torch.int32
        for j, (w, tokens) in enumerate(want):
            assert allowed(bitmask[j]) == expected(grammars, w.c, tokens), (w.c.describe(), tokens)
        seen.update(w.rid for w, _ in want)
    assert len(masks) == len(seen)


# -- GrammarMasks: the cases ----------------------------------------------------------------


def mask_of(masks: GrammarMasks, rows: Sequence[SampleRow]) -> list[set[int]]:
    got = masks.mask(rows, lambda rid: pytest.fail(f"{rid} is not pending"))
    assert got is not None
    return [allowed(r) for r in got[1]]


def test_a_reused_id_unreleased_gets_a_new_matcher(grammars: Grammars) -> None:
    """A new request under an id whose matcher was not released: the same constraint, as many
    tokens, the same last one — its output list is another object, so it is not the old one."""
    c = Constraint.choice(["xa", "ya", "xab"])
    grammars.check(c)
    masks = GrammarMasks(grammars, [EOS])
    assert mask_of(masks, [sample_row("r", c, list(b"xa"))]) == [{ord("b"), EOS}]
    assert mask_of(masks, [sample_row("r", c, list(b"ya"))]) == [{EOS}]


def test_a_reused_id_with_another_constraint_gets_a_new_matcher(grammars: Grammars) -> None:
    masks = GrammarMasks(grammars, [EOS])
    assert mask_of(masks, [sample_row("r", CHOICE, b"gre")]) == [{ord("e"), ord("y")}]
    assert len(masks) == 1
    # the same id, as many tokens, the same last one: only the constraint tells them apart
    word = Constraint(ConstraintKind.REGEX, "[a-z]+")
    grammars.check(word)
    assert mask_of(masks, [sample_row("r", word, b"xre")]) == [{*range(ord("a"), ord("z") + 1), EOS}]
    assert len(masks) == 1
    assert mask_of(masks, [sample_row("q", CHOICE, b"")]) == [expected(grammars, CHOICE, b"")]
    assert len(masks) == 2
    masks.release("r")
    masks.release("r")  # twice: nothing left to forget
    masks.release("unknown")
    assert len(masks) == 1
    masks.release("q")
    assert len(masks) == 0
    assert masks.mask([sample_row("r", None)], lambda rid: 0) is None
    assert len(masks) == 0


def test_a_released_id_starts_over(grammars: Grammars) -> None:
    """A new request under a released id, its output as long as the old one and ending in the
    same token: a new matcher, not the old one's state."""
    c = Constraint.choice(["xa", "ya", "xab"])
    grammars.check(c)
    masks = GrammarMasks(grammars, [EOS])
    assert mask_of(masks, [sample_row("r", c, b"xa")]) == [{ord("b"), EOS}]
    masks.release("r")
    assert mask_of(masks, [sample_row("r", c, b"ya")]) == [{EOS}]


def test_a_terminated_row_masks_nothing(grammars: Grammars) -> None:
    masks = GrammarMasks(grammars, [EOS])
    assert mask_of(masks, [sample_row("r", CHOICE, b"red")]) == [{EOS}]
    done = [*b"red", EOS]
    assert mask_of(masks, [sample_row("r", CHOICE, done)]) == [set(range(VOCAB))]
    # tokens an overlapped step computed past the end are not fed to the matcher
    assert mask_of(masks, [sample_row("r", CHOICE, [*done, 7, 300 % VOCAB])]) == [set(range(VOCAB))]
    got = masks.mask([sample_row("r", CHOICE, done)], lambda rid: 0)
    assert got is not None and (got[1] == -1).all()  # every word, padding bits included


def test_a_token_outside_the_grammar_ends_the_row(
    grammars: Grammars, caplog: pytest.LogCaptureFixture
) -> None:
    masks = GrammarMasks(grammars, [EOS])
    out = list(b"rex")  # the request's output list, one object for its life
    with caplog.at_level(logging.ERROR, logger="pdserve.model_runtime.structured.matchers"):
        assert mask_of(masks, [sample_row("r", CHOICE, out)]) == [{EOS}]
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert "r: token 120 is outside its constraint choice" in caplog.text
    caplog.clear()
    # broken it stays (and says so once): more tokens change nothing
    out.append(ord("d"))
    assert mask_of(masks, [sample_row("r", CHOICE, out)]) == [{EOS}]
    assert not caplog.records
    # a rewind to tokens the grammar allows rebuilds it
    del out[1:]
    assert mask_of(masks, [sample_row("r", CHOICE, out)]) == [{ord("e")}]


def test_json_rows_never_allow_a_control_byte(grammars: Grammars) -> None:
    m = xgr.GrammarMatcher(grammars.compiled(SHORT_STRING))
    assert m.accept_token(ord('"'))
    raw = xgr.allocate_token_bitmask(1, VOCAB)
    m.fill_next_token_bitmask(raw)
    ctl = controls(grammars)
    assert allowed(raw[0]) & ctl, "the engine's own grammar admits raw controls in a string"
    masks = GrammarMasks(grammars, [EOS])
    for text in (b'"', b'"ab'):
        (got,) = mask_of(masks, [sample_row("s", SHORT_STRING, text)])
        assert not got & ctl
        assert {ord("a"), ord(" "), ord('"')} <= got
    # a regex row keeps what its grammar allows (controls included)
    line = Constraint(ConstraintKind.REGEX, r"[\x00-\x1f]x")
    grammars.check(line)
    assert mask_of(masks, [sample_row("x", line)]) == [set(range(32))]


# -- apply ------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [[0, 1, 2, 3, 4], [1, 3], [0], [4]])
def test_apply_equals_the_engines_kernel(grammars: Grammars, index: list[int]) -> None:
    torch.manual_seed(len(index))
    logits = torch.randn(5, VOCAB)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(index), WORDS), dtype=torch.int32)
    bitmask[0] = _only_row({3, 40, 255})
    full = torch.full((5, WORDS), -1, dtype=torch.int32)
    full[index] = bitmask
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, full, vocab_size=VOCAB)
    got = logits.clone()
    apply(got, index, bitmask)
    assert torch.equal(got, want)
    assert torch.isinf(got[index[0]]).sum() == VOCAB - 3
    for i in set(range(5)) - set(index):
        assert torch.equal(got[i], logits[i])


def _only_row(ids: set[int]) -> torch.Tensor:
    bits = torch.zeros(WORDS * 32, dtype=torch.bool)
    bits[sorted(ids)] = True
    weights = torch.tensor([1 << b if b < 31 else -(1 << 31) for b in range(32)], dtype=torch.int64)
    return (bits.view(WORDS, 32).long() * weights).sum(1).to(torch.int32)


# -- the Sampler ------------------------------------------------------------------------------

# (request, constraint, output so far): states with many, few and two allowed tokens
STATES = [
    ("a", SCHEMA, b'{"n": '),
    ("b", REGEX, b"a1"),
    ("c", CHOICE, b"gre"),
    ("d", SHORT_STRING, b'"x'),
    ("e", CHOICE, b""),
]


@pytest.mark.parametrize("seed", [None, 7])
def test_a_constrained_row_only_ever_takes_an_allowed_token(grammars: Grammars, seed: int | None) -> None:
    torch.manual_seed(0)
    sampler = Sampler(grammars, [EOS])
    greedy = seed is None
    for draw_ in range(40):
        logits = torch.randn(len(STATES), VOCAB) * 4
        rows = [
            sample_row(f"{rid}{draw_}", c, out, temperature=0.0 if greedy else 1.3, seed=seed)
            for rid, c, out in STATES
        ]
        res = sampler(logits, rows)
        for i, (_, c, out) in enumerate(STATES):
            ok = expected(grammars, c, out)
            assert res.token_ids[i] in ok
            if greedy:
                best = max(ok, key=lambda t: logits[i, t].item())
                assert res.token_ids[i] == best


def test_constrained_logprobs_are_of_the_masked_distribution(grammars: Grammars) -> None:
    torch.manual_seed(1)
    logits = torch.randn(len(STATES), VOCAB) * 3
    rows = [sample_row(rid, c, out, temperature=1.0, seed=3, logprobs=5) for rid, c, out in STATES]
    res = Sampler(grammars, [EOS])(logits, rows)
    for i, (_, c, out) in enumerate(STATES):
        ok = sorted(expected(grammars, c, out))
        masked = torch.full((VOCAB,), float("-inf"))
        masked[ok] = logits[i, ok]
        lp = torch.log_softmax(masked, dim=0)
        got = res.logprobs[i]
        assert got is not None and got.token_id == res.token_ids[i]
        assert got.logprob == pytest.approx(lp[got.token_id].item(), abs=1e-5)
        top = sorted(ok, key=lambda t: -lp[t].item())[:5]
        assert [t for t, _ in got.top] == top  # fewer than 5 where fewer are allowed
        assert all(math.isfinite(v) and v == pytest.approx(lp[t].item(), abs=1e-5) for t, v in got.top)
    assert len(res.logprobs[2].top) == 2  # type: ignore[union-attr]


def test_an_unconstrained_row_is_unchanged_by_a_constrained_one(grammars: Grammars) -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB)
    free = [
        sample_row("f0", None, [4, 5], temperature=0.8, seed=11, logprobs=4),
        sample_row("f1", None, [6], temperature=0.0, logprobs=2, repetition_penalty=1.2),
    ]
    alone = Sampler(grammars, [EOS])(logits[[0, 2]], free)
    mixed = Sampler(grammars, [EOS])(logits, [free[0], sample_row("c", CHOICE, b"g", logprobs=4), free[1]])
    assert mixed.token_ids[1] in {ord("r")}
    assert [mixed.token_ids[0], mixed.token_ids[2]] == alone.token_ids
    assert [mixed.logprobs[0], mixed.logprobs[2]] == alone.logprobs


def test_a_pending_row_is_masked_after_the_token_in_flight(grammars: Grammars) -> None:
    sampler = Sampler(grammars, [EOS])
    logits = torch.zeros(2, VOCAB)
    logits[:, ord("e")] = 5.0  # 'e' is the best token where it is allowed: after "gr" or "gre"
    free = sample_row("free", None, temperature=0.0)
    first = sampler.launch(logits[:1], [sample_row("r", CHOICE, b"g", temperature=0.0)])
    # each step launches before the one before it is read: its input is the token in flight
    second = sampler.launch(logits, [free, sample_row("r", CHOICE, b"g", pending=1, temperature=0.0)])
    assert first.result().token_ids == [ord("r")]
    third = sampler.launch(logits[:1], [sample_row("r", CHOICE, b"gr", pending=1, temperature=0.0)])
    assert second.result().token_ids == [ord("e"), ord("e")]
    assert third.result().token_ids == [ord("e")]  # "gre" + 'e': green


def test_release_forgets_every_constrained_request(grammars: Grammars) -> None:
    sampler = Sampler(grammars, [EOS])
    rows = [sample_row(rid, c, out, frequency_penalty=0.5) for rid, c, out in STATES[:3]]
    sampler(torch.randn(4, VOCAB), [*rows, sample_row("free", None, frequency_penalty=0.5)])
    assert sampler.kept_requests() == 3 + 4  # matchers, then penalty counts
    for rid in ("a", "b", "c", "free"):
        sampler.release(rid)
    assert sampler.kept_requests() == 0


def test_a_constrained_row_needs_grammars() -> None:
    with pytest.raises(RuntimeError, match="without grammars"):
        Sampler()(torch.zeros(1, VOCAB), [sample_row("r", CHOICE)])


# -- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize("field_", ["min_tokens", "ignore_eos"])
def test_a_constraint_refuses_what_would_override_its_end(field_: str) -> None:
    value: object = 2 if field_ == "min_tokens" else True
    SamplingParams(**{field_: value}).validate(VOCAB)  # type: ignore[arg-type]
    SamplingParams(constraint=CHOICE).validate(VOCAB)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(constraint=CHOICE, **{field_: value}).validate(VOCAB)  # type: ignore[arg-type]
    assert e.value.field == field_
