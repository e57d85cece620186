"""The prepared GPU check rehearsed on the CPU, so that a GPU loan never finds it broken."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[2]
KEYS = (
    "gpu",
    "copy_gbs",
    "matmul_tflops",
    "decode_mbu_b1",
    "decode_mbu_b64",
    "host_overhead_ratio",
    "host_overhead_ratio_lone",
    "decode_b1_engine_step_ms",
    "prefill_mfu_2k",
    "prefill_mfu_8k",
    "handoff_fixed_ms",
    "handoff_exposed_fixed_ms",
)


def _dry_run(module: str, *flags: str) -> dict[str, object]:
    """``module``'s CPU rehearsal; its last line's JSON."""
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--dry-run", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cast(dict[str, object], json.loads(proc.stdout.strip().splitlines()[-1]))


def test_gpu_engine_check_dry_run_writes_every_key(tmp_path: Path) -> None:
    last: dict[str, Any] = _dry_run("gpu_engine_check", "--out", str(tmp_path))
    written = json.loads((tmp_path / "gpu_engine_check.json").read_text())
    assert written == last
    assert "errors" not in last, last.get("errors")
    for key in KEYS:
        assert key in last, key
        assert not isinstance(last[key], float) or last[key] == last[key], key  # not NaN
    assert last["handoff"]["byte_exact"] is True
    assert last["decode_mbu_b1"] > 0 and last["prefill_mfu_2k"] > 0
    assert set(last["profile"]) == {"decode_b1", "decode_b4", "prefill_128"}
    assert (tmp_path / "profile.txt").stat().st_size > 0


def test_attention_kernel_sweep_dry_run_ranks_its_settings(tmp_path: Path) -> None:
    _dry_run("attention_kernels", "--out", str(tmp_path))
    report = json.loads((tmp_path / "attention_kernels.json").read_text())
    want = {"decode": ["capacity/n16w4s1", "s4_m16/n16w4s1"], "prefill": ["m16n16w4s1", "m32n16w4s1"]}
    for kernel, names in want.items():
        sweep = report[kernel]
        assert not sweep["errors"], sweep["errors"]
        assert sorted(name for name, _ in sweep["ranked"]) == names
        scores = [score for _, score in sweep["ranked"]]
        assert scores == sorted(scores) and scores[0] >= 1.0  # each shape's best is its reference
        for shape, best in sweep["best_us"].items():
            assert best == min(ms[shape] for ms in sweep["ms"].values()) * 1e3
        assert all(v > 0 for v in sweep["best_of_ceiling"].values())


def test_a_failing_phase_is_recorded_and_the_rest_still_written(tmp_path: Path) -> None:
    from benchmarks.gpu_engine_check import Report

    out: dict[str, object] = {"gpu": "x"}
    report = Report(tmp_path / "r.json", out)

    def fails() -> None:
        out["half"] = 1
        raise RuntimeError("CUDA error: an illegal memory access")

    assert not report.phase("decode_b1", fails)
    assert report.phase("handoff", lambda: out.update(handoff_fixed_ms=0.2))
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["errors"] == {"decode_b1": "RuntimeError: CUDA error: an illegal memory access"}
    assert written["half"] == 1 and written["handoff_fixed_ms"] == 0.2


def test_the_check_runs_with_a_sweeps_best_settings(tmp_path: Path) -> None:
    from benchmarks.gpu_engine_check import best_tuning

    sweep = {
        "decode": {"ranked": [["capacity/n64w4s3", 1.0], ["s8_m64/n32w2s4", 1.1]]},
        "prefill": {"ranked": [["m128n64w8s2", 1.0], ["m64n64w4s3", 1.2]]},
    }
    assert best_tuning(sweep).decode_name == "s8_m64/n32w2s4"  # the capacity grid is no setting
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    flags = ["--skip-handoff", "--tuning-from", str(tmp_path / "sweep.json"), "--out", str(tmp_path / "out")]
    last = _dry_run("gpu_engine_check", *flags)
    assert last["tuning"] == {"decode": "s8_m64/n32w2s4", "prefill": "m128n64w8s2"}
    assert "handoff" not in last and "errors" not in last
