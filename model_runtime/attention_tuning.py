"""The paged attention kernels' settings (pure: no torch): how decode splits a row, and how
both kernels are compiled and launched.

Decode is split-K: each row shares the positions it attends to among ``decode_splits``
programs per KV head, each taking at least ``decode_min_split_tokens``. The split is fixed
rather than sized to the batch, so a row's result depends on its own length alone (the same
tokens whatever shares its step). The grid used to be sized to the block table's capacity (a
split per 256 positions the longest context could hold): at 64 rows of 1k tokens under an 8k
limit six programs in seven were empty and still wrote a partial the merge read. Rows up to 4k
tokens keep that grid's 256-position splits (the same work per program); longer rows take 16
larger shares instead of more programs.

Launch settings change speed only (and the order of a row's sums, never with its batch). The
defaults are Triton's own warps and stages, the settings of the first H200 measurement
(``BENCHMARKS.md``); ``benchmarks/attention_kernels.py`` sweeps the alternatives.

One value per process (``current``): the kernels read it at each call, so a benchmark can
measure other settings through the whole engine (``use``) without a second code path. Set it
before the model runs: CUDA graphs keep the settings they were captured with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


def _positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _power_of_2(**values: int) -> None:
    for name, v in values.items():
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of 2 of at least 16, got {v}")


@dataclass(frozen=True)
class DecodeLaunch:
    """Positions a tile (``block_n``), warps a program, software-pipeline stages."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        _positive(block_n=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)
        _power_of_2(block_n=self.block_n)

    @property
    def name(self) -> str:
        return f"n{self.block_n}w{self.num_warps}s{self.num_stages}"


@dataclass(frozen=True)
class PrefillLaunch:
    """Query rows a program (``block_m``), keys a tile (``block_n``), warps, stages."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        _positive(
            block_m=self.block_m, block_n=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages
        )
        _power_of_2(block_m=self.block_m, block_n=self.block_n)

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"


_DECODE_NAME = re.compile(r"s(\d+)_m(\d+)/n(\d+)w(\d+)s(\d+)")
_PREFILL_NAME = re.compile(r"m(\d+)n(\d+)w(\d+)s(\d+)")


@dataclass(frozen=True)
class AttentionTuning:
    decode_splits: int = 16
    decode_min_split_tokens: int = 256
    decode: DecodeLaunch = field(default_factory=DecodeLaunch)
    prefill: PrefillLaunch = field(default_factory=PrefillLaunch)

    def __post_init__(self) -> None:
        _positive(decode_splits=self.decode_splits, decode_min_split_tokens=self.decode_min_split_tokens)

    @property
    def decode_name(self) -> str:
        """``s<splits>_m<min tokens>/n<block>w<warps>s<stages>``: the sweep's name for it."""
        return f"s{self.decode_splits}_m{self.decode_min_split_tokens}/{self.decode.name}"

    @classmethod
    def from_names(cls, decode: str, prefill: str) -> AttentionTuning:
        """The settings the sweep names (``decode_name``, ``PrefillLaunch.name``)."""
        d, p = _DECODE_NAME.fullmatch(decode), _PREFILL_NAME.fullmatch(prefill)
        if d is None or p is None:
            bad = decode if d is None else prefill
            raise ValueError(f"not a decode (s16_m256/n64w4s3) or prefill (m64n64w4s3) setting: {bad!r}")
        s, m, n, w, st = (int(x) for x in d.groups())
        return cls(s, m, DecodeLaunch(n, w, st), PrefillLaunch(*(int(x) for x in p.groups())))


DEFAULT = AttentionTuning()
_current = DEFAULT


def current() -> AttentionTuning:
    return _current


def use(tuning: AttentionTuning) -> None:
    """Every kernel call from now on uses ``tuning`` (see the module's note on graphs)."""
    global _current
    _current = tuning
