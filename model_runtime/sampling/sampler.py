"""Batched sampling with per-request parameters.

Order of transforms on a row of float32 logits (each skipped when neutral for every row):

1. log-probabilities for reporting, taken from the raw logits (before any transform);
2. repetition penalty (CTRL): over prompt and output tokens, positive logits are divided by
   the penalty and negative ones multiplied by it;
3. frequency and presence penalties (OpenAI): over output tokens,
   ``logit -= frequency * count + presence * (count > 0)``;
4. ``min_tokens``: while fewer tokens were generated, EOS and ``stop_token_ids`` are masked;
4b. a constrained row's grammar mask (``structured.matchers``): tokens the constraint does not
   allow next are masked, EOS included unless the grammar accepts here; the row's log-probabilities
   are then of the constrained distribution (the mask applied to the raw logits);
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

On a GPU nothing here waits for the device: the batch's parameters reach it in one upload (and
none while the batch's composition repeats, as it does from one decode step to the next),
penalty counts live on the device (``penalties``), and the sampled ids with their
log-probabilities come back in one non-blocking copy that ``SampledStep.result`` waits for, so
the next step can be launched first (its inputs read ``SampledStep.tokens`` on the device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.model_runtime.sampling.logprob import Logprob
from pdserve.model_runtime.sampling.penalties import PenaltyCounts
from pdserve.model_runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.model_runtime.structured.compiler import Grammars
    from pdserve.model_runtime.structured.matchers import GrammarMasks


@dataclass
class SampleRow:
    """One row to sample: its parameters and the history penalties read. ``request_id`` keys
    the row's device-side penalty counts ("": none kept)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    eos_ids: frozenset[int]
    request_id: str = ""
    pending: int = 0  # tokens sampled on the device, not yet in ``output_ids`` (an overlapped step)

    @property
    def num_output(self) -> int:
        """Output tokens before the one this row samples (its position in the output)."""
        return len(self.output_ids) + self.pending

    @property
    def seed(self) -> int | None:
        return None if self.params.seed is None else position_seed(self.params.seed, self.num_output)


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


# Columns of ``BatchParams.values``.
_TEMP, _MIN_P, _TOP_K, _TOP_P, _REP, _FREQ, _PRES = range(7)


@dataclass
class BatchParams:
    """A batch composition's parameters on the device: ``values`` [rows, 7] (the columns above),
    and the rows that are not greedy (``sampled``) and that have a penalty (``penalized``), as
    device index tensors and as lists."""

    key: tuple[float, ...]
    values: torch.Tensor
    sampled_rows: list[int]
    sampled: torch.Tensor
    penalized_rows: list[int]
    penalized: torch.Tensor


def batch_params(
    rows: Sequence[SampleRow], device: torch.device, last: BatchParams | None = None
) -> BatchParams:
    """``last`` when the composition is the same, else one upload of everything."""
    key = tuple(
        v
        for r in rows
        for v in (
            r.params.temperature,
            r.params.min_p,
            float(r.params.top_k),
            r.params.top_p,
            r.params.repetition_penalty,
            r.params.frequency_penalty,
            r.params.presence_penalty,
        )
    )
    if last is not None and last.key == key and last.values.device == device:
        return last
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    penalized = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    packed = torch.tensor([*key, *sampled, *penalized], dtype=torch.float64).to(device, non_blocking=True)
    n = 7 * len(rows)
    values = packed[:n].view(len(rows), 7).to(torch.float32)
    index = packed[n:].long()
    return BatchParams(key, values, sampled, index[: len(sampled)], penalized, index[len(sampled) :])


def apply_penalties(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    params: BatchParams | None = None,
    counts: PenaltyCounts | None = None,
) -> None:
    """In place, on the rows with a non-neutral penalty."""
    if params is None:
        params = batch_params(rows, logits.device)
    if not params.penalized_rows:
        return
    sub_rows = [rows[i] for i in params.penalized_rows]
    seen, emitted = (counts if counts is not None else PenaltyCounts()).rows(
        [r.request_id for r in sub_rows],
        [r.prompt_ids for r in sub_rows],
        [r.output_ids for r in sub_rows],
        logits.shape[1],
        logits.device,
        [r.pending for r in sub_rows],
    )
    p = params.values.index_select(0, params.penalized)
    rep, freq, pres = p[:, _REP : _REP + 1], p[:, _FREQ : _FREQ + 1], p[:, _PRES : _PRES + 1]
    sub = logits.index_select(0, params.penalized)
    # A neutral factor leaves a value bit-for-bit as it was (x / 1, x * 1, x - 0).
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= freq * emitted + pres * (emitted > 0).to(sub.dtype)
    logits.index_copy_(0, params.penalized, sub)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    for i, r in enumerate(rows):
        p = r.params
        if r.num_output < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_ids))
            ids = [t for t in banned if t < logits.shape[1]]
            if ids:
                logits[i, ids] = float("-inf")


def filter_probs(
    logits: torch.Tensor, rows: Sequence[SampleRow], values: torch.Tensor | None = None
) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p on the (non-greedy) rows; returns probabilities.
    ``values``: the rows' ``BatchParams.values`` (built here when not given)."""
    if values is None:
        values = batch_params(rows, logits.device).values
    logits = logits / values[:, _TEMP : _TEMP + 1]
    probs = torch.softmax(logits, dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        threshold = values[:, _MIN_P : _MIN_P + 1] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    vocab = logits.shape[1]
    need_k = any(0 < r.params.top_k < vocab for r in rows)
    need_p = any(r.params.top_p < 1.0 for r in rows)
    if need_k or need_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if need_k:
            ks = values[:, _TOP_K].long()
            ks = torch.where((ks > 0) & (ks < vocab), ks, vocab)
            keep &= torch.arange(vocab, device=logits.device).unsqueeze(0) < ks.unsqueeze(1)
        if need_p:
            masked = sorted_probs * keep
            total = masked.sum(dim=-1, keepdim=True)
            before = (masked.cumsum(dim=-1) - masked) / total  # mass strictly above each token
            keep &= before < values[:, _TOP_P : _TOP_P + 1]
        keep[:, 0] = True
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    seeds = [r.seed for r in rows]
    noise = torch.empty_like(probs)
    if None in seeds:  # one draw for the whole batch; seeded rows are drawn again below
        noise.exponential_()
    for i, seed in enumerate(seeds):
        if seed is not None:
            g = torch.Generator(device=probs.device).manual_seed(seed)
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


class SampledStep:
    """A step's sampled ids on the device, and their copy to the host (with the log-probabilities
    asked for) under way. ``result`` waits for the copy (once; later calls return the same)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        host: torch.Tensor,
        done: torch.cuda.Event | None,
        want: list[int | None],
        k: int,
    ) -> None:
        self.tokens = tokens  # [rows] int64, on the device
        self._host, self._done, self._want, self._k = host, done, want, k
        self._result: SampleResult | None = None

    def result(self) -> SampleResult:
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> SampleResult:
        if self._done is not None:
            self._done.synchronize()
        table = self._host.tolist()
        k = self._k
        ids = [int(r[0]) for r in table]
        logprobs: list[Logprob | None] = []
        for w, r in zip(self._want, table, strict=True):
            if w is None:
                logprobs.append(None)
                continue
            pairs = zip(r[2 : 2 + w], r[2 + k : 2 + k + w], strict=True)
            # (a constrained row may have fewer allowed tokens than alternatives asked for)
            top = tuple((int(t), v) for t, v in pairs if v != float("-inf"))
            logprobs.append(Logprob(int(r[0]), r[1], top))
        return SampleResult(ids, logprobs)


class _HostRing:
    """Pinned host buffers for the copies out, two in turn: a step's copy must not land in the
    buffer the step before it still has to read (two steps are in flight when they overlap)."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def copy_out(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if t.device.type != "cuda":
            return t.cpu(), None
        i, self._turn = self._turn, 1 - self._turn
        ev = self._events[i]
        if ev is not None:
            # Steps are read in launch order, so the one that used this buffer, two launches ago,
            # was read before this launch: the wait is for a copy already done.
            ev.synchronize()
        n = t.numel()
        buf = self._bufs[i]
        if buf is None or buf.numel() < n:
            buf = self._bufs[i] = torch.empty(max(n, 4096), dtype=t.dtype, pin_memory=True)
        host = buf[:n].view(t.shape)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))  # the copy's stream, not the current device's
        self._events[i] = done
        return host, done


class Sampler:
    """Samples a step's rows; keeps per request the penalty counts and the grammar matchers of
    constrained requests (``release`` drops both). ``grammars``: the process's compiled
    constraints (``structured.compiler.Grammars``); without them no row may be constrained."""

    def __init__(self, grammars: Grammars | None = None, eos_ids: Sequence[int] = ()) -> None:
        self.penalties = PenaltyCounts()
        self.grammars = grammars
        self._eos_ids = tuple(eos_ids)
        self._masks: GrammarMasks | None = None  # made at the first constrained row
        self._last: BatchParams | None = None
        self._ring = _HostRing()
        # The step launched last: its rows and tokens (a pending row's input); the rows' index by
        # request id is built only when a constrained pending row asks (``_pending_token``).
        self._previous: tuple[Sequence[SampleRow], SampledStep] | None = None
        self._previous_index: dict[str, int] | None = None

    def release(self, request_id: str) -> None:
        self.penalties.release(request_id)
        if self._masks is not None:
            self._masks.release(request_id)

    def kept_requests(self) -> int:
        return len(self.penalties) + (len(self._masks) if self._masks is not None else 0)

    def _pending_token(self, request_id: str) -> int:
        if self._previous is None:
            raise RuntimeError(f"{request_id}: its input is pending but no step was launched before")
        rows, step = self._previous
        if self._previous_index is None:
            self._previous_index = {r.request_id: i for i, r in enumerate(rows)}
        row = self._previous_index.get(request_id)
        if row is None:
            raise RuntimeError(f"{request_id}: its input is pending but the previous step sampled none")
        return step.result().token_ids[row]

    def _grammar_mask(self, rows: Sequence[SampleRow]) -> tuple[list[int], torch.Tensor] | None:
        if all(r.params.constraint is None for r in rows):
            return None
        if self._masks is None:
            if self.grammars is None:
                raise RuntimeError("a constrained row on a sampler without grammars")
            from pdserve.model_runtime.structured.matchers import GrammarMasks

            self._masks = GrammarMasks(self.grammars, self._eos_ids)
        return self._masks.mask(rows, self._pending_token)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
        """``logits``: float32 [len(rows), vocab]. Does not modify the caller's tensor."""
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampledStep:
        """Sample on the device and start the copy out; returns without waiting for either."""
        raw = logits
        logits = logits.clone()
        params = self._last = batch_params(rows, logits.device, self._last)
        apply_penalties(logits, rows, params, self.penalties)
        apply_min_tokens(logits, rows)
        masked = self._grammar_mask(rows)
        if masked is not None:
            from pdserve.model_runtime.structured.matchers import apply

            apply(logits, *masked)
        chosen = logits.argmax(dim=-1)
        if params.sampled_rows:
            sub = [rows[i] for i in params.sampled_rows]
            values = params.values.index_select(0, params.sampled)
            probs = filter_probs(logits.index_select(0, params.sampled), sub, values)
            chosen.index_copy_(0, params.sampled, draw(probs, sub))
        if params.penalized_rows:
            self.penalties.advance(
                [rows[i].request_id for i in params.penalized_rows], chosen.index_select(0, params.penalized)
            )
        want = [r.params.logprobs for r in rows]
        k = max((w or 0 for w in want), default=0)
        parts = [chosen.unsqueeze(1).to(torch.float64)]  # float64 holds ids and logprobs exactly
        if any(w is not None for w in want):
            if masked is not None:
                raw = raw.clone()
                apply(raw, *masked)
            lp = torch.log_softmax(raw, dim=-1)
            parts.append(lp.gather(1, chosen.unsqueeze(1)).to(torch.float64))
            if k:
                top_v, top_i = lp.topk(k, dim=-1)
                parts += [top_i.to(torch.float64), top_v.to(torch.float64)]
        host, done = self._ring.copy_out(torch.cat(parts, dim=1))
        step = SampledStep(chosen, host, done, want, k)
        self._previous, self._previous_index = (rows, step), None
        return step
