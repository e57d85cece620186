"""Batched sampling with per-request parameters.

Order of transforms on a row of float32 logits (each skipped when neutral for every row):

1. log-probabilities for reporting, taken from the raw logits (before any transform);
2. repetition penalty (CTRL): over prompt and output tokens, positive logits are divided by
   the penalty and negative ones multiplied by it;
3. frequency and presence penalties (OpenAI): over output tokens,
   ``logit -= frequency * count + presence * (count > 0)``;
4. ``min_tokens``: while fewer tokens were generated, EOS and ``stop_token_ids`` are masked;
5. greedy rows (temperature 0) take the argmax here;
6. temperature: logits / T;
7. min_p: tokens with probability below ``min_p * max probability`` are masked;
8. top_k: tokens outside the k largest logits are masked;
9. top_p: the smallest set of most-likely tokens whose probability reaches ``top_p`` is kept;
10. a draw: ``argmax(probs / Exp(1) noise)``, an exact sample from ``probs``. A seeded row's
    noise is a full vocabulary row drawn from a generator seeded by (seed, position of the
    token drawn), so a request's samples depend only on its seed and its own tokens: never on
    the rest of the batch, on which worker drew the earlier tokens, or on any state kept
    between steps (a request resumed elsewhere, or a re-used id, draws exactly the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.model_runtime.sampling.logprob import Logprob
from pdserve.model_runtime.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """One row to sample: its parameters and the history penalties read."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    eos_ids: frozenset[int]

    @property
    def seed(self) -> int | None:
        return None if self.params.seed is None else position_seed(self.params.seed, len(self.output_ids))


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the token at output ``position`` of a request seeded ``seed``: a
    SplitMix64 finaliser over both, so neighbouring seeds and positions get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[Logprob | None]


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """In place, for rows with a non-neutral penalty."""
    device = logits.device
    for i, r in enumerate(rows):
        p = r.params
        if not p.needs_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*r.prompt_ids, *r.output_ids}), dtype=torch.long, device=device)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and r.output_ids:
            out = torch.tensor(list(r.output_ids), dtype=torch.long, device=device)
            counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_ids) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_ids))
            ids = [t for t in banned if t < logits.shape[1]]
            if ids:
                logits[i, ids] = float("-inf")


def filter_probs(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p on the (non-greedy) rows; returns probabilities."""
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], device=device, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    probs = torch.softmax(logits, dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], device=device, dtype=probs.dtype)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    vocab = logits.shape[1]
    need_k = any(0 < r.params.top_k < vocab for r in rows)
    need_p = any(r.params.top_p < 1.0 for r in rows)
    if need_k or need_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if need_k:
            ks = torch.tensor(
                [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows], device=device
            )
            keep &= torch.arange(vocab, device=device).unsqueeze(0) < ks.unsqueeze(1)
        if need_p:
            masked = sorted_probs * keep
            total = masked.sum(dim=-1, keepdim=True)
            before = (masked.cumsum(dim=-1) - masked) / total  # mass strictly above each token
            ps = torch.tensor([r.params.top_p for r in rows], device=device, dtype=probs.dtype)
            keep &= before < ps.unsqueeze(1)
        keep[:, 0] = True
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.seed is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, r in enumerate(rows):
        seed = r.seed
        if seed is not None:
            g = torch.Generator(device=probs.device).manual_seed(seed)
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def compute_logprobs(
    raw: torch.Tensor, chosen: torch.Tensor, rows: Sequence[SampleRow]
) -> list[Logprob | None]:
    want = [r.params.logprobs for r in rows]
    if all(w is None for w in want):
        return [None] * len(rows)
    lp = torch.log_softmax(raw, dim=-1)
    k = max(w or 0 for w in want)
    top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    out: list[Logprob | None] = []
    for i, w in enumerate(want):
        if w is None:
            out.append(None)
            continue
        top: tuple[tuple[int, float], ...] = ()
        if w and top_v is not None and top_i is not None:
            top = tuple(zip(top_i[i, :w].tolist(), top_v[i, :w].tolist(), strict=True))
        out.append(Logprob(int(chosen[i]), float(chosen_lp[i]), top))
    return out


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
        """``logits``: float32 [len(rows), vocab]. Does not modify the caller's tensor."""
        raw = logits
        logits = logits.clone()
        apply_penalties(logits, rows)
        apply_min_tokens(logits, rows)
        chosen = logits.argmax(dim=-1)
        sampled_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled_rows:
            sub = [rows[i] for i in sampled_rows]
            probs = filter_probs(logits[sampled_rows], sub)
            chosen[sampled_rows] = draw(probs, sub)
        return SampleResult(chosen.tolist(), compute_logprobs(raw, chosen, rows))
