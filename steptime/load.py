"""Profiles by name or from JSON files (pure Python).

A file holds one object with a ``kind``: ``"roofline"`` (``RooflineProfile``'s fields, the
default when ``kind`` is absent), ``"fitted"`` (``FittedProfile``'s: ``pdserve profile`` writes
these) or ``"dilated"`` (``{"factor": x, "base": {...}}``). Other rooms add kinds of their own
(the simulator's host calibration) by passing ``kinds``. A name or path may end in
``@x<factor>``: every duration stretched (``pdserve.steptime.dilation``); a name may end in
``@tp<N>`` (before any ``@x``): the model on workers of ``N`` GPUs (``pdserve.steptime.parallel``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from pdserve.steptime.dilation import Dilated, split_dilation
from pdserve.steptime.fitted import FittedProfile
from pdserve.steptime.model import StepTimeModel
from pdserve.steptime.parallel import at_tp
from pdserve.steptime.roofline import PROFILES, RooflineProfile, split_tp

Parser = Callable[[dict[str, Any]], StepTimeModel]


T = TypeVar("T")


def build_fields(cls: type[T], data: Mapping[str, Any]) -> T:
    """A dataclass of plain fields from a JSON object: unknown fields refused."""
    unknown = set(data) - {f.name for f in fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    return cls(**data)


def from_fields(cls: Any) -> Parser:
    """A parser for a profile that is a dataclass of plain fields."""
    return lambda data: build_fields(cls, data)


def _dilated(data: dict[str, Any]) -> StepTimeModel:
    if set(data) != {"factor", "base"}:
        raise ValueError("a dilated profile has exactly 'factor' and 'base'")
    factor = float(data["factor"])
    if not 1.0 <= factor <= 1000.0:
        raise ValueError(f"time dilation factor must be within 1..1000, got {factor:g}")
    return Dilated(parse_profile(data["base"]), factor)


KINDS: dict[str, Parser] = {
    RooflineProfile.KIND: from_fields(RooflineProfile),
    FittedProfile.KIND: from_fields(FittedProfile),
    "dilated": _dilated,
}


def parse_profile(data: object, kinds: Mapping[str, Parser] = KINDS) -> StepTimeModel:
    """A profile from its JSON object (as ``to_json`` writes it)."""
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    data = dict(data)
    kind = data.pop("kind", RooflineProfile.KIND)
    if kind not in kinds:
        raise ValueError(f"unknown kind {kind!r} (one of {', '.join(kinds)})")
    try:
        return kinds[kind](data)
    except TypeError as e:  # a missing or mistyped field
        raise ValueError(str(e)) from None


def load_profile(name_or_path: str, kinds: Mapping[str, Parser] = KINDS) -> StepTimeModel:
    """A built-in profile by name, or a JSON file of one of ``kinds``."""
    base, factor = split_dilation(name_or_path)
    if base != name_or_path:
        return Dilated(load_profile(base, kinds), factor) if factor != 1.0 else load_profile(base, kinds)
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    name, tp = split_tp(name_or_path)
    if tp is not None and not Path(name_or_path).is_file():
        return at_tp(load_profile(name, kinds), tp)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown latency profile {name_or_path!r}: not built in ({', '.join(PROFILES)}) and not a file"
        )
    try:
        return parse_profile(json.loads(path.read_text()), kinds)
    except ValueError as e:  # json.JSONDecodeError is one
        raise ValueError(f"{path}: not a latency profile ({e})") from None
