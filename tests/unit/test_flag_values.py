"""The shared ``type=`` checks of ``pdserve.flags``, and the flags that use them."""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.cli import build_parser
from pdserve.flags import finite_at_least, int_at_least, port, positive_finite, share


def _takes(parse: object, text: str) -> bool:
    try:
        parse(text)  # type: ignore[operator]
    except argparse.ArgumentTypeError:
        return False
    return True


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_float_checks_take_exactly_their_range(x: float) -> None:
    text = repr(x)
    assert _takes(finite_at_least(0.0), text) == (math.isfinite(x) and x >= 0)
    assert _takes(finite_at_least(1.0), text) == (math.isfinite(x) and x >= 1)
    assert _takes(positive_finite, text) == (math.isfinite(x) and x > 0)
    assert _takes(share, text) == (0 < x <= 1)


@given(st.integers(min_value=-(10**7), max_value=10**7))
def test_int_checks_take_exactly_their_range(n: int) -> None:
    assert _takes(int_at_least(1), str(n)) == (n >= 1)
    assert _takes(port, str(n)) == (0 <= n <= 65535)


@pytest.mark.parametrize(
    "flags",
    [
        ["--temperature", "nan"],
        ["--temperature", "-1"],
        ["--max-concurrency", "0"],
        ["--sweep-target", "0"],
        ["--sweep-target", "1.5"],
        ["--sweep-target", "nan"],
        ["--sweep-min-rate", "0"],
        ["--sweep-steps", "-1"],
        ["--sweep-max-doublings", "-1"],
        ["--sweep-seeds", "0"],
    ],
)
def test_bench_refuses_absurd_settings_by_name(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", *flags])
    assert f"argument {flags[0]}: must be" in capsys.readouterr().err
