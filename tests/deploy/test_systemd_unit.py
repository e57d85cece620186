"""The systemd unit: a stop must reach pdserve alone (``KillMode=mixed``), given time for the
drain, and the file must be one systemd accepts."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "pdserve.service"


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNIT)
    return parser


def test_a_stop_signals_pdserve_alone_and_waits_out_its_drain() -> None:
    service = unit()["Service"]
    assert service["KillMode"] == "mixed" and service["KillSignal"] == "SIGTERM"
    drain = re.search(r"--drain-timeout (\d+)", service["ExecStart"])
    assert drain is not None
    assert int(service["TimeoutStopSec"]) >= int(drain.group(1)) + 20  # the drain, then the shutdown
    assert "--host 127.0.0.1" in service["ExecStart"]  # private unless the operator says otherwise


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_accepts_the_unit() -> None:
    out = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True, timeout=60)
    # The unit's binary does not exist on a build machine; anything else is a real error.
    problems = [line for line in out.stderr.splitlines() if line.strip() and "is not executable" not in line]
    assert not problems, out.stderr
