from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdserve.model_runtime.sampling.sampler import (
    Sampler,
    SampleRow,
    apply_min_tokens,
    apply_penalties,
    filter_probs,
)
from pdserve.model_runtime.sampling_params import SamplingParams


def row(
    params: SamplingParams,
    prompt: list[int] | None = None,
    out: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
) -> SampleRow:
    return SampleRow(params, prompt or [], out or [], eos)


def test_repetition_penalty_ctrl_style() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    apply_penalties(logits, [row(SamplingParams(repetition_penalty=2.0), prompt=[0], out=[1])])
    assert logits.tolist() == [[1.0, -2.0, 0.5, 3.0]]


def test_frequency_and_presence_penalties_openai_style() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    apply_penalties(logits, [row(p, prompt=[0], out=[2, 2, 3])])  # prompt tokens are not counted
    assert logits.tolist() == [[1.0, 1.0, -1.0, -0.5]]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    p = SamplingParams(min_tokens=2, stop_token_ids=(2,), temperature=0)
    apply_min_tokens(logits, [row(p, out=[3], eos=frozenset({1}))])
    assert logits[0, 1] == -math.inf and logits[0, 2] == -math.inf
    r = Sampler()(torch.tensor([[0.0, 5.0, 4.0, 1.0]]), [row(p, out=[3, 3], eos=frozenset({1}))])
    assert r.token_ids == [1]  # enough tokens: EOS allowed again


PROBS = [0.5, 0.3, 0.15, 0.05]


def probs_after(**kw: float) -> list[float]:
    logits = torch.tensor([PROBS]).log()
    return filter_probs(logits, [row(SamplingParams(**kw))])[0].tolist()  # type: ignore[arg-type]


def test_min_p_threshold() -> None:
    got = probs_after(min_p=0.2)  # threshold 0.1: only 0.05 is dropped
    assert got == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_top_p_nucleus() -> None:
    assert probs_after(top_p=0.7) == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert probs_after(top_p=0.85) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert probs_after(top_p=0.3) == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_top_k_and_temperature() -> None:
    assert probs_after(top_k=2) == pytest.approx([0.625, 0.375, 0.0, 0.0])
    sq = [p * p for p in PROBS]
    assert probs_after(temperature=0.5) == pytest.approx([s / sum(sq) for s in sq])


def test_sampled_frequencies_match_probabilities() -> None:
    n = 20_000
    logits = torch.tensor([PROBS]).log().repeat(n, 1)
    res = Sampler()(logits, [row(SamplingParams(temperature=1.0))] * n)
    freq = torch.bincount(torch.tensor(res.token_ids), minlength=4).float() / n
    assert freq.tolist() == pytest.approx(PROBS, abs=0.015)


def test_top_k_never_leaves_the_top_k() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 100) * 3
    top5 = set(logits[0].topk(5).indices.tolist())
    n = 3000
    res = Sampler()(logits.repeat(n, 1), [row(SamplingParams(temperature=1.5, top_k=5))] * n)
    assert set(res.token_ids) <= top5
    assert len(set(res.token_ids)) == 5


def test_seeded_samples_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(1)
    steps = [torch.randn(3, 64) for _ in range(20)]
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)

    def run(batch_pos: int, batch_size: int) -> list[int]:
        others = [row(SamplingParams(temperature=1.0)) for _ in range(batch_size - 1)]
        toks = []
        for logits in steps:
            rows = list(others)
            rows.insert(batch_pos, row(p, out=list(toks)))
            batch = logits[:1].repeat(batch_size, 1)
            toks.append(Sampler()(batch, rows).token_ids[batch_pos])
        return toks

    alone = run(0, 1)
    assert run(2, 3) == alone
    assert run(1, 5) == alone
    assert len(set(alone)) > 3  # it really sampled


def test_seeded_draw_depends_on_seed_and_position_only() -> None:
    """No generator state survives a step: the same (seed, position) draws the same token in a
    fresh sampler, and another position or seed draws from another stream."""
    torch.manual_seed(3)
    logits = torch.randn(1, 256)
    p = SamplingParams(temperature=1.0, seed=9)

    def tok(params: SamplingParams, pos: int) -> int:
        return Sampler()(logits, [row(params, out=[5] * pos)]).token_ids[0]

    first = [tok(p, pos) for pos in range(12)]
    assert [tok(p, pos) for pos in range(12)] == first
    assert len(set(first)) > 3
    other = [tok(SamplingParams(temperature=1.0, seed=10), pos) for pos in range(12)]
    assert other != first


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 1e-6])
def test_tiny_temperature_is_greedy(temperature: float) -> None:
    """Logits / 1e-40 overflow to inf and softmax to NaN, whose argmax is token 0: such
    temperatures must sample greedily instead."""
    logits = torch.tensor([[0.5, 2.0, 9.0, -1.0], [7.0, 1.0, 0.0, 0.0]])
    p = SamplingParams(temperature=temperature, seed=1)
    assert p.greedy
    assert Sampler()(logits, [row(p), row(p)]).token_ids == [2, 0]


def test_greedy_applies_penalties_and_ignores_filters() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    res = Sampler()(logits, [row(SamplingParams(temperature=0, repetition_penalty=1.5, top_k=1), out=[0])])
    assert res.token_ids == [1]


def test_logprobs_are_raw_and_sorted() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    res = Sampler()(logits, [row(SamplingParams(temperature=0, logprobs=2))])
    lp = res.logprobs[0]
    assert lp is not None
    ref = torch.log_softmax(logits[0], -1)
    assert lp.token_id == 1 and lp.logprob == pytest.approx(float(ref[1]))
    assert [t for t, _ in lp.top] == [1, 2]
    assert lp.top[1][1] == pytest.approx(float(ref[2]))
    assert Sampler()(logits, [row(SamplingParams(temperature=0))]).logprobs == [None]


@given(
    st.lists(st.integers(0, 11), min_size=0, max_size=6),
    st.floats(0.5, 2.0),
    st.floats(-1.0, 1.0),
    st.floats(-1.0, 1.0),
    st.integers(1, 12),
)
def test_device_side_penalty_counts_equal_a_rebuild_every_step(
    prompt: list[int], rep: float, freq: float, pres: float, steps: int
) -> None:
    """A request's counts advanced on the device step after step transform the logits exactly
    as counts rebuilt from its token lists would, and release leaves nothing behind."""
    gen = torch.Generator().manual_seed(len(prompt) * 31 + steps)
    params = SamplingParams(
        temperature=0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres
    )
    other = SamplingParams(temperature=0)
    sampler = Sampler()
    output: list[int] = []
    for _ in range(steps):
        logits = torch.randn(2, 12, generator=gen)
        rows = [
            SampleRow(params, prompt, list(output), frozenset(), "a"),
            SampleRow(other, [], [], frozenset(), "b"),
        ]
        want = logits.clone()
        apply_penalties(want, [SampleRow(params, prompt, list(output), frozenset())])  # rebuilt
        got = sampler(logits, rows).token_ids
        assert got[0] == int(want[0].argmax())
        output.append(got[0])
    assert sampler.kept_requests() == int(params.needs_penalties)  # only a penalized request keeps counts
    sampler.release("a")
    assert sampler.kept_requests() == 0


def test_penalty_counts_rebuild_when_the_request_moved_on_without_them() -> None:
    """A token the sampler did not see (the request resumed elsewhere, or the engine dropped
    one) makes the lengths disagree: the counts are rebuilt rather than trusted."""
    p = SamplingParams(temperature=0, frequency_penalty=5.0)
    sampler = Sampler()
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    assert sampler(logits, [SampleRow(p, [], [], frozenset(), "x")]).token_ids == [0]
    # Two tokens 1 appeared meanwhile, not the 0 the sampler counted.
    assert sampler(logits, [SampleRow(p, [], [1, 1], frozenset(), "x")]).token_ids == [0]
    # Stale counts ({0: 2, 1: 2} by now) would pick 2; the rebuilt ones ({1: 1}) keep 0.
    assert sampler(logits, [SampleRow(p, [], [1], frozenset(), "x")]).token_ids == [0]
    sampler.release("x")
    assert sampler.kept_requests() == 0
