"""A step-time model fitted to measurements of a real engine (pure Python).

For hardware whose roofline efficiencies are not known (a CPU): ``pdserve profile`` times the
engine's steps and ``FittedProfile.fit`` fits DistServe's iteration-time form to them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar

from pdserve.steptime.model import Chunks, StepTimeModel, decode_features, is_decode_chunk, prefill_features


def _solve(a: list[list[float]], y: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; ``None`` when ``a`` is singular."""
    n = len(y)
    m = [[*row, y[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * yv for x, yv in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_relative(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[float, ...]:
    """Non-negative coefficients ``θ`` minimising Σ ((x·θ − y) / y)², the relative error.

    Relative rather than absolute error, so a 20 ms decode step counts as much as a 1 s
    prefill. Exact for the handful of coefficients used here: every subset of coefficients is
    solved unconstrained (the rest held at zero) and the best solution with no negative
    coefficient wins. Columns are scaled to unit norm first, so seconds per token and per
    token² do not meet in one badly conditioned matrix.
    """
    if not xs or len(xs) != len(ys):
        raise ValueError("need as many measurements as feature rows, at least one")
    if any(y <= 0 for y in ys):
        raise ValueError("measured times must be positive")
    k = len(xs[0])
    rows = [[x / y for x in row] for row, y in zip(xs, ys, strict=True)]  # relative: divide by y
    scale = [max(1e-300, sum(r[j] ** 2 for r in rows) ** 0.5) for j in range(k)]
    rows = [[r[j] / scale[j] for j in range(k)] for r in rows]
    best: tuple[float, list[float]] | None = None
    for size in range(1, k + 1):
        for free in itertools.combinations(range(k), size):
            ata = [[sum(r[i] * r[j] for r in rows) for j in free] for i in free]
            aty = [sum(r[i] for r in rows) for i in free]  # targets are all 1 after scaling
            sol = _solve(ata, aty)
            if sol is None or any(v < 0 for v in sol):
                continue
            theta = [0.0] * k
            for j, v in zip(free, sol, strict=True):
                theta[j] = v
            loss = sum((sum(r[j] * theta[j] for j in range(k)) - 1.0) ** 2 for r in rows)
            if best is None or loss < best[0] - 1e-15:
                best = (loss, theta)
    if best is None:
        return tuple(0.0 for _ in range(k))
    return tuple(t / s for t, s in zip(best[1], scale, strict=True))


def relative_errors(model: StepTimeModel, steps: Iterable[tuple[Chunks, float]]) -> list[float]:
    """(predicted − measured) / measured for each measured step."""
    return [(model.step_time(chunks) - t) / t for chunks, t in steps]


@dataclass(frozen=True)
class FittedProfile:
    """A step-time model fitted to measurements of a real engine (DistServe's form).

    One forward pass over a packed batch takes

        prefill part   a_p + b_p·Σl + c_p·Σ l·(l + 2c)      over prefill chunks (l new after c cached)
      + decode part    a_d + b_d·Σctx + c_d·B               over B decode tokens with contexts ctx

    each part only when the step has such chunks. DistServe writes the prefill part with
    ``Σl²``: the attention of a fresh prompt. A chunk continuing after ``c`` cached tokens
    attends from its ``l`` queries to ``c + l`` keys, ``l·c + l²/2`` pairs against ``l²/2``
    for a fresh prompt, hence ``l·(l + 2c)``; its linear layers see only the ``l`` new tokens.
    (Gathering the cached prefix is a copy proportional to ``c``, small against such a step's
    attention; it is left out.)

    A mixed step (a chunked-prefill step with decodes riding along) is charged both parts in
    full, with no overlap. The engine runs them in one forward pass, but what the decodes add
    is not hidden under the prefill: their attention runs after the projections that feed
    it, over their own KV, and their rows and sampling add to every layer's work. Only the
    decodes' share of streaming the weights could be shared, and a prefill chunk is
    compute-bound; charging the decode part's base ``a_d`` again makes this an upper bound by at
    most ``a_d`` per mixed step. ``pdserve profile`` measures mixed steps and reports this
    model's error on them.

    A KV hand-off of ``n`` tokens takes ``link_latency_s + n · kv_bytes_per_token / link_bw``
    (measured over the worker's real transport when ``pdserve profile`` can). The KV capacity is
    the measured engine's pool.
    """

    KIND: ClassVar[str] = "fitted"

    name: str
    prefill_base_s: float  # a_p
    prefill_per_token_s: float  # b_p
    prefill_per_token2_s: float  # c_p
    decode_base_s: float  # a_d
    decode_per_context_s: float  # b_d
    decode_per_seq_s: float  # c_d
    link_latency_s: float
    link_bw: float  # bytes/s
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    max_model_len: int
    source: str = ""  # what was measured, how, where
    prefill_fit_median_error: float = 0.0  # |relative error| of the fit on its own points
    prefill_fit_max_error: float = 0.0
    decode_fit_median_error: float = 0.0
    decode_fit_max_error: float = 0.0

    def __post_init__(self) -> None:
        coeffs = (self.prefill_base_s, self.prefill_per_token_s, self.prefill_per_token2_s,
                  self.decode_base_s, self.decode_per_context_s, self.decode_per_seq_s,
                  self.link_latency_s)  # fmt: skip
        if any(not c >= 0 for c in coeffs):
            raise ValueError("fitted coefficients must be >= 0")
        if not (self.link_bw > 0 and self.kv_bytes_per_token > 0 and self.kv_capacity_tokens > 0):
            raise ValueError("link_bw, kv_bytes_per_token and kv_capacity_tokens must be > 0")
        if self.max_model_len <= 0:
            raise ValueError("max_model_len must be > 0")

    @property
    def prefill_coefficients(self) -> tuple[float, float, float]:
        return (self.prefill_base_s, self.prefill_per_token_s, self.prefill_per_token2_s)

    @property
    def decode_coefficients(self) -> tuple[float, float, float]:
        return (self.decode_base_s, self.decode_per_context_s, self.decode_per_seq_s)

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        return self.mixed_time(chunks, 0, 0)

    def mixed_time(self, chunks: Iterable[tuple[int, int]], decodes: int, decode_context: int) -> float:
        cs = list(chunks)  # read twice
        p = prefill_features(cs)
        _, ctx, b = decode_features(cs)
        b, ctx = b + decodes, ctx + decode_context + decodes  # a decode's context holds itself
        d = (1.0 if b else 0.0, ctx, b)
        return sum(c * x for c, x in zip(self.prefill_coefficients, p, strict=True)) + sum(
            c * x for c, x in zip(self.decode_coefficients, d, strict=True)
        )

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.step_time([(new_tokens, cached_tokens)])

    def decode_time(self, batch: int, total_context: int) -> float:
        """A decode step for ``batch`` requests whose contexts sum to ``total_context``."""
        if batch == 0:
            return 0.0
        return self.decode_base_s + self.decode_per_context_s * total_context + self.decode_per_seq_s * batch

    def transfer_time(self, tokens: int) -> float:
        return self.link_latency_s + tokens * self.kv_bytes_per_token / self.link_bw

    def to_json(self) -> str:
        return json.dumps({"kind": self.KIND, **asdict(self)}, indent=2)

    @classmethod
    def fit(
        cls,
        name: str,
        prefill_steps: Sequence[tuple[Chunks, float]],
        decode_steps: Sequence[tuple[Chunks, float]],
        *,
        link_latency_s: float,
        link_bw: float,
        kv_bytes_per_token: int,
        kv_capacity_tokens: int,
        max_model_len: int,
        source: str = "",
    ) -> FittedProfile:
        """Fit both parts by relative-error least squares: the prefill part on steps with only
        prefill chunks, the decode part on steps with only decode tokens."""
        for steps, want_prefill in ((prefill_steps, True), (decode_steps, False)):
            for chunks, _ in steps:
                kinds = {is_decode_chunk(n, c) for n, c in chunks}
                if kinds != {not want_prefill}:
                    what = "prefill chunks only" if want_prefill else "decode tokens only"
                    raise ValueError(f"a {'prefill' if want_prefill else 'decode'} step must hold {what}")
        pf = [prefill_features(c) for c, _ in prefill_steps]
        ap, bp, cp = fit_relative(pf, [t for _, t in prefill_steps])
        df = [decode_features(c) for c, _ in decode_steps]
        ad, bd, cd = fit_relative(df, [t for _, t in decode_steps])
        profile = cls(
            name=name, prefill_base_s=ap, prefill_per_token_s=bp, prefill_per_token2_s=cp,
            decode_base_s=ad, decode_per_context_s=bd, decode_per_seq_s=cd,
            link_latency_s=link_latency_s, link_bw=link_bw, kv_bytes_per_token=kv_bytes_per_token,
            kv_capacity_tokens=kv_capacity_tokens, max_model_len=max_model_len, source=source,
        )  # fmt: skip
        pe = [abs(e) for e in relative_errors(profile, prefill_steps)]
        de = [abs(e) for e in relative_errors(profile, decode_steps)]
        return dataclasses.replace(
            profile,
            prefill_fit_median_error=statistics.median(pe), prefill_fit_max_error=max(pe),
            decode_fit_median_error=statistics.median(de), decode_fit_max_error=max(de),
        )  # fmt: skip
