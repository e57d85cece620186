"""A dead node is noticed within 8 s: a second Ray node's raylet is SIGKILLed and the control
plane, with the health checks pdserve sets on the Ray instances it starts, declares the node and
the actor it hosted dead in time (Ray's defaults take about twice as long)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_a_dead_node_is_declared_dead_within_8_s() -> None:
    cmd = [sys.executable, "-m", "benchmarks.node_loss"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True, cwd=ROOT)
    result = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith("{")))
    assert result["settings"] == "pdserve"
    assert result["node_dead_s"] is not None and result["node_dead_s"] <= 8.0, result
    assert result["actor_dead_s"] is not None and result["actor_dead_s"] <= 8.0, result
