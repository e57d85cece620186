"""``benchmarks/sim_farm.py``: points files, the compact result, and a real two-point run with a
deadline that stops one of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sim_farm import compact, parse_points

ROOT = Path(__file__).resolve().parents[2]


def test_points_file_parsing() -> None:
    pts = parse_points("# comment\n\na-1: --prefill 1 --decode 1  # trailing\nb_2: --colocated 2\n")
    assert pts == [("a-1", ["--prefill", "1", "--decode", "1"]), ("b_2", ["--colocated", "2"])]
    for bad in ("no colon here", "a b: --x", "a: --x\na: --y"):
        with pytest.raises(SystemExit):
            parse_points(bad)


def test_compact_counts_shed_requests_and_their_prompt_tokens() -> None:
    errors = ["", "RESOURCE_EXHAUSTED: rejected", "", "not finished"]
    m = {"slo_attainment": 0.5, "num_prompts": 4, "itls": [[0.1] * 9], "input_lens": [100, 300, 100, 500]}
    m["errors"] = errors
    c = compact(m, ["--x"])
    assert c["rejected"] == 1 and c["rejected_fraction"] == 0.25
    assert c["rejected_prompt_token_fraction"] == pytest.approx(300 / 1000)
    assert "itls" not in c and c["flags"] == "--x"


def test_farm_runs_points_in_parallel_and_stops_at_the_deadline(tmp_path: Path) -> None:
    """Two slots: a long point holds one until the deadline stops it, while the other runs two
    short points one after the other; a stale result of an earlier run is not reported."""
    pts = tmp_path / "p.txt"
    pts.write_text(
        "quick: --prefill 1 --decode 1 --num-prompts 20 --random-input-len 200 --random-output-len 8\n"
        # 20 million decode tokens through one engine: minutes of simulation, a few MB of prompts
        "slow: --colocated 1 --num-prompts 50000 --request-rate 5000 --random-input-len 100"
        " --random-output-len 400\n"
        "third: --colocated 1 --num-prompts 5 --random-input-len 50 --random-output-len 4\n"
    )
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "slow.json").write_text('{"slo_attainment": 1.0}')  # from an earlier run
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.sim_farm", "--points", str(pts), "--out-dir", str(tmp_path / "o"),
         "--jobs", "2", "--deadline-s", "15"],
        capture_output=True, text=True, timeout=120, check=True, cwd=ROOT,
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])["points"]
    assert summary["quick"]["status"] == "ok" and summary["quick"]["completed"] == 20
    assert summary["third"]["status"] == "ok" and summary["third"]["completed"] == 5
    assert summary["slow"] == {"status": "stopped at the deadline"}
    assert json.loads((tmp_path / "o" / "quick.json").read_text())["layout"] == "1P+1D"
