"""How long a step takes on a given GPU: the latency model behind emulated workers (pure Python).

One forward pass over a packed batch is modelled without assuming that attention hides under
the GEMMs (it does not: attention kernels run after the projections that feed them):

    t = overhead + max(linear FLOPs / (peak · mfu), weight bytes / (bandwidth · mbu))
          + attention FLOPs of prefill chunks / (peak · mfu_attn)
          + KV bytes the decodes read / (bandwidth · mbu)

Linear FLOPs are 2 · parameters per token; a prefill chunk of ``n`` new tokens after ``c``
cached ones does ``4 · layers · heads · head_dim · n · (c + n/2)`` attention FLOPs; a decode
token reads its whole context's KV. A KV transfer of ``n`` tokens takes ``latency + n · KV
bytes per token / link bandwidth``.

The built-in ``h100-llama3-8b`` is calibrated on published kernel measurements (field notes
§8): a 2,048-token prefill ≈ 47 ms (mfu ≈ 0.72) and a batch-1 decode step ≈ 6.6 ms (mbu ≈
0.75); its link is NVLink-class (NCCL send/recv ≈ 100 GB/s).

``FittedProfile`` is the other kind: DistServe's iteration-time form with coefficients fitted to
measurements of a real engine (``pdserve profile``), for hardware whose roofline efficiencies
are not known — this CPU. Both kinds satisfy ``LatencyModel`` and load from JSON with
``load_profile`` (a ``kind`` field says which; files without one are rooflines).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import ClassVar, Protocol


class LatencyModel(Protocol):
    """What the simulator, emulated workers and the router need from a latency profile."""

    @property
    def name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int: ...

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """One forward pass over ``(new tokens, tokens already cached)`` per request."""
        ...

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float: ...

    def decode_time(self, batch: int, total_context: int) -> float: ...

    def transfer_time(self, tokens: int) -> float: ...

    def to_json(self) -> str: ...


@dataclass(frozen=True)
class LatencyProfile:
    KIND: ClassVar[str] = "roofline"

    name: str
    # model
    params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_model_len: int
    # hardware
    peak_flops: float
    mem_bw: float  # bytes/s
    memory_bytes: float  # per GPU
    link_bw: float  # bytes/s between two workers
    link_latency_s: float
    # efficiencies
    mfu: float = 0.72
    mfu_attn: float = 0.5
    mbu: float = 0.75
    step_overhead_s: float = 0.0002
    kv_memory_fraction: float = 0.9  # of what the weights leave free

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_capacity_tokens(self) -> int:
        free = max(0.0, self.memory_bytes - self.weight_bytes) * self.kv_memory_fraction
        return int(free // self.kv_bytes_per_token)

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """One forward pass over ``(new tokens, tokens already cached)`` per request."""
        tokens = 0
        attn_flops = 0.0
        kv_read = 0.0
        per_layer = 4 * self.layers * self.heads * self.head_dim
        for new, cached in chunks:
            tokens += new
            if new == 1 and cached > 0:  # a decode token reads its whole context
                kv_read += (cached + 1) * self.kv_bytes_per_token
            else:
                attn_flops += per_layer * new * (cached + new / 2)
        if tokens == 0:
            return 0.0
        linear = max(
            2 * self.params * tokens / (self.peak_flops * self.mfu),
            self.weight_bytes / (self.mem_bw * self.mbu),
        )
        return (
            self.step_overhead_s
            + linear
            + attn_flops / (self.peak_flops * self.mfu_attn)
            + kv_read / (self.mem_bw * self.mbu)
        )

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.step_time([(new_tokens, cached_tokens)])

    def decode_time(self, batch: int, total_context: int) -> float:
        """A decode step for ``batch`` requests whose contexts sum to ``total_context``."""
        if batch == 0:
            return 0.0
        avg = int(total_context / batch)
        if avg == 0:
            return self.step_time([(1, 0)] * batch)
        # step_time of ``batch`` decode tokens, in closed form (routers call this per option)
        linear = max(
            2 * self.params * batch / (self.peak_flops * self.mfu),
            self.weight_bytes / (self.mem_bw * self.mbu),
        )
        kv_read = batch * (avg + 1) * self.kv_bytes_per_token
        return self.step_overhead_s + linear + kv_read / (self.mem_bw * self.mbu)

    def transfer_time(self, tokens: int) -> float:
        return self.link_latency_s + tokens * self.kv_bytes_per_token / self.link_bw

    def to_json(self) -> str:
        return json.dumps({"kind": self.KIND, **asdict(self)}, indent=2)


H100_LLAMA3_8B = LatencyProfile(
    name="h100-llama3-8b",
    params=8.03e9,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    dtype_bytes=2,
    max_model_len=131072,
    peak_flops=989e12,
    mem_bw=3.35e12,
    memory_bytes=80e9,
    link_bw=100e9,
    link_latency_s=50e-6,
)

PROFILES: dict[str, LatencyModel] = {p.name: p for p in (H100_LLAMA3_8B,)}


# -- fitted profiles ---------------------------------------------------------------------------

Chunks = Sequence[tuple[int, int]]


def quantile_grid_checked(name: str, grid: Iterable[float]) -> tuple[float, ...]:
    """``grid`` as a tuple, if it is a quantile grid: empty, or at least two positive,
    non-decreasing values."""
    g = tuple(float(q) for q in grid)
    if g and (len(g) < 2 or g[0] <= 0 or any(b < a for a, b in itertools.pairwise(g))):
        raise ValueError(f"{name} must be >= 2 positive, non-decreasing quantiles")
    return g


def coactivity_factor(
    profile: object, has_prefill: bool, others_busy: bool, others_prefilling: bool
) -> float:
    """How much slower a step runs on a host it shares, by what the host's other workers run as
    it starts (``FittedProfile.prefill_coactive_x`` / ``decode_coactive_x``; 1 for a profile
    without them): a step with prefill work beside any other step, a decode-only step beside a
    step with prefill work. The simulator applies it; the service fit models steps with it."""
    if has_prefill:
        return float(getattr(profile, "prefill_coactive_x", 1.0)) if others_busy else 1.0
    return float(getattr(profile, "decode_coactive_x", 1.0)) if others_prefilling else 1.0


def is_decode_chunk(new: int, cached: int) -> bool:
    """A decode token: one new token after a cached context (the convention of every profile)."""
    return new == 1 and cached > 0


def prefill_features(chunks: Iterable[tuple[int, int]]) -> tuple[float, float, float]:
    """``(1, Σl, Σ l·(l + 2c))`` over the prefill chunks (``l`` new tokens after ``c`` cached);
    all zero when the step has none."""
    n = sq = 0.0
    any_chunk = False
    for new, cached in chunks:
        if is_decode_chunk(new, cached) or new <= 0:
            continue
        any_chunk = True
        n += new
        sq += new * (new + 2 * cached)
    return (1.0 if any_chunk else 0.0, n, sq)


def decode_features(chunks: Iterable[tuple[int, int]]) -> tuple[float, float, float]:
    """``(1, Σctx, B)`` over the decode tokens (context = cached + the token itself); all zero
    when the step has none."""
    b = ctx = 0.0
    for new, cached in chunks:
        if is_decode_chunk(new, cached):
            b += 1
            ctx += cached + 1
    return (1.0 if b else 0.0, ctx, b)


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


def relative_errors(model: LatencyModel, steps: Iterable[tuple[Chunks, float]]) -> list[float]:
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
    (Gathering the cached prefix is a copy proportional to ``c``; on this CPU it is under 1 %
    of such a step and is left out.)

    A mixed step (a chunked-prefill step with decodes riding along) is charged both parts in
    full, with no overlap. The engine runs them in one forward pass, but what the decodes add
    is not hidden under the prefill: their attention runs after the projections that feed
    it, over their own KV, and their rows and sampling add to every layer's work. Only the
    decodes' share of streaming the weights could be shared, and a prefill chunk is
    compute-bound; charging the decode part's base ``a_d`` again makes this an upper bound by at
    most ``a_d`` per mixed step. ``pdserve profile`` measures mixed steps and reports this
    model's error on them.

    ``decode_coactive_x`` and ``prefill_coactive_x`` describe workers that share one host (this
    CPU's cores, caches and memory system, and the router and client running beside them): a
    decode-only step takes ``decode_coactive_x`` times as long while another worker on the host
    runs a step with prefill work, and a step with prefill work ``prefill_coactive_x`` times as
    long while another worker steps at all. GPUs do not share like that, so both are 1 unless
    measured (from the running service's step logs, ``pdserve.simulator.service_fit``), and the
    simulator applies them only to a deployment it is told shares a host (``--shared-host``).

    ``service_prefill_s`` + ``service_prefill_x`` x and ``service_decode_s`` +
    ``service_decode_x`` x turn the engine's step into the serving worker's: a step with
    prefill work (mixed steps included) takes the first, a decode-only step the second — whole
    steps, as the service's step logs measure them (``pdserve.simulator.service_fit``), because what
    slows a serving worker's step does not split along the prefill and decode parts: a
    constant a step (the router and client taking a core from a multi-threaded step) and a
    factor (a slower core, the worker's other threads). 0 and 1 for the engine alone.

    ``prefill_jitter`` / ``decode_jitter`` and ``jitter_corr`` say how the serving worker's real
    steps scatter around all of the above (quantiles of measured / modelled at equally spaced
    probabilities, median 1; and how long slow stretches last): the simulator draws each step's
    factor from them (``pdserve.simulator.jitter``), because SLO attainment is decided in the tails a
    deterministic step time does not have. Empty (deterministic) unless measured from the
    service's step logs (``pdserve.simulator.service_fit``); this describes the step times, not the
    engine, so ``step_time`` stays the typical step.

    ``step_overhead_s`` is added to every step: what a serving worker spends per step beyond the
    engine's own ``step()`` (its loop, output push, transfer polling, and the router and client
    sharing its cores). ``pdserve profile`` measures the engine alone and leaves it at 0;
    ``benchmarks/sim_validation.py`` measures it from the running service at zero load, on top
    of the service factors and constants above.

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
    step_overhead_s: float = 0.0  # per step, beyond the engine's step(): measured from the service
    service_prefill_x: float = 1.0  # the serving worker's step with prefill work / the engine's
    service_decode_x: float = 1.0  # the same, decode-only steps
    service_prefill_s: float = 0.0  # added to each step with prefill work in the serving worker
    service_decode_s: float = 0.0  # the same, decode-only steps
    decode_coactive_x: float = 1.0  # decode-only step, while another worker on the host prefills
    prefill_coactive_x: float = 1.0  # step with prefill, while another worker on the host steps
    prefill_jitter: tuple[float, ...] = ()  # quantiles of measured / modelled, median 1 (steps with prefill)
    decode_jitter: tuple[float, ...] = ()  # the same, decode-only steps
    jitter_corr: float = 0.0  # lag-1 correlation of a worker's successive steps' variability
    prefill_fit_median_error: float = 0.0  # |relative error| of the fit on its own points
    prefill_fit_max_error: float = 0.0
    decode_fit_median_error: float = 0.0
    decode_fit_max_error: float = 0.0

    def __post_init__(self) -> None:
        coeffs = (self.prefill_base_s, self.prefill_per_token_s, self.prefill_per_token2_s,
                  self.decode_base_s, self.decode_per_context_s, self.decode_per_seq_s,
                  self.link_latency_s, self.step_overhead_s)  # fmt: skip
        if any(c < 0 for c in coeffs):
            raise ValueError("fitted coefficients must be >= 0")
        if self.link_bw <= 0 or self.kv_bytes_per_token <= 0 or self.kv_capacity_tokens <= 0:
            raise ValueError("link_bw, kv_bytes_per_token and kv_capacity_tokens must be > 0")
        if self.max_model_len <= 0:
            raise ValueError("max_model_len must be > 0")
        if self.decode_coactive_x < 1 or self.prefill_coactive_x < 1:
            raise ValueError("co-activity factors are slowdowns: >= 1")
        if self.service_prefill_x <= 0 or self.service_decode_x <= 0:
            raise ValueError("service factors must be > 0")
        if self.service_prefill_s < 0 or self.service_decode_s < 0:
            raise ValueError("service constants must be >= 0")
        for name in ("prefill_jitter", "decode_jitter"):  # JSON gives lists
            object.__setattr__(self, name, quantile_grid_checked(name, getattr(self, name)))
        if not 0 <= self.jitter_corr < 1:
            raise ValueError("jitter_corr must be in [0, 1)")

    @property
    def prefill_coefficients(self) -> tuple[float, float, float]:
        return (self.prefill_base_s, self.prefill_per_token_s, self.prefill_per_token2_s)

    @property
    def decode_coefficients(self) -> tuple[float, float, float]:
        return (self.decode_base_s, self.decode_per_context_s, self.decode_per_seq_s)

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        cs = list(chunks)
        p = prefill_features(cs)
        d = decode_features(cs)
        if not (p[0] or d[0]):
            return 0.0
        engine = sum(c * x for c, x in zip(self.prefill_coefficients, p, strict=True)) + sum(
            c * x for c, x in zip(self.decode_coefficients, d, strict=True)
        )
        if p[0]:
            return self.step_overhead_s + self.service_prefill_s + engine * self.service_prefill_x
        return self.step_overhead_s + self.service_decode_s + engine * self.service_decode_x

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.step_time([(new_tokens, cached_tokens)])

    def decode_time(self, batch: int, total_context: int) -> float:
        """A decode step for ``batch`` requests whose contexts sum to ``total_context``."""
        if batch == 0:
            return 0.0
        d = self.decode_per_context_s * total_context + self.decode_per_seq_s * batch
        return self.step_overhead_s + self.service_decode_s + (self.decode_base_s + d) * self.service_decode_x

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


KINDS: dict[str, type[LatencyProfile] | type[FittedProfile]] = {
    LatencyProfile.KIND: LatencyProfile,
    FittedProfile.KIND: FittedProfile,
}


def load_profile(name_or_path: str) -> LatencyModel:
    """A built-in profile by name, or a JSON file of either kind: ``{"kind": "roofline", ...}``
    with ``LatencyProfile``'s fields (the default when ``kind`` is absent) or ``{"kind":
    "fitted", ...}`` with ``FittedProfile``'s (``pdserve profile`` writes these). A suffix
    ``@x<factor>`` stretches every duration (``pdserve.model_runtime.time_dilation``)."""
    from pdserve.model_runtime.time_dilation import Dilated, split_dilation

    base, factor = split_dilation(name_or_path)
    if base != name_or_path:
        return Dilated(load_profile(base), factor) if factor != 1.0 else load_profile(base)
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown latency profile {name_or_path!r}: not built in ({', '.join(PROFILES)}) and not a file"
        )
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        kind = data.pop("kind", LatencyProfile.KIND)
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r} (one of {', '.join(KINDS)})")
        cls = KINDS[kind]
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a latency profile ({e})") from None
