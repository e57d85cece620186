"""Run many ``pdserve simulate`` points in parallel, one process each, under a wall-clock deadline.

A points file has one point a line, ``NAME: FLAGS`` (the flags of ``pdserve simulate``; ``#``
starts a comment). Points start in file order, at most ``--jobs`` at once; each writes
``OUT_DIR/NAME.json`` (the summary without the per-request arrays) as soon as it finishes, so a
run cut short by ``--deadline-s`` (running points are stopped, pending ones skipped) still leaves
every finished point. The last line printed is JSON: each point's attainment, rate and status.

Standard library plus the project's pure packages only, so it runs on any Python, e.g. a GPU
host's many CPU cores:

    python -m benchmarks.sim_farm --points POINTS.txt --out-dir DIR --jobs 16 --deadline-s 480
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KEEP = (
    "slo_attainment", "request_throughput", "request_goodput", "completed", "failed", "num_prompts",
    "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
    "layout", "policy", "admission", "colocated_schedule", "request_rate", "decisions", "duration",
    "work_bound_rate_per_gpu", "offered_load_vs_bound", "admitted_load_vs_bound", "simulation_wall_s",
)  # fmt: skip


def parse_points(text: str) -> list[tuple[str, list[str]]]:
    points = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, flags = line.partition(":")
        if not sep or not name.strip().replace("-", "").replace("_", "").isalnum():
            raise SystemExit(f"points line {lineno}: expected 'NAME: FLAGS', got {raw!r}")
        points.append((name.strip(), shlex.split(flags)))
    if len({n for n, _ in points}) != len(points):
        raise SystemExit("points: names must be unique")
    return points


def compact(m: dict[str, Any], flags: list[str]) -> dict[str, Any]:
    out = {k: m[k] for k in KEEP if k in m}
    rejected = sum(1 for e in m.get("errors", []) if e and "RESOURCE_EXHAUSTED" in e)
    total = m.get("num_prompts") or 1
    out["rejected"] = rejected
    out["rejected_fraction"] = rejected / total
    lens, errs = m.get("input_lens", []), m.get("errors", [])
    if rejected and len(lens) == len(errs):
        shed = sum(n for n, e in zip(lens, errs, strict=True) if e and "RESOURCE_EXHAUSTED" in e)
        out["rejected_prompt_token_fraction"] = shed / max(1, sum(lens))
    out["flags"] = " ".join(flags)
    return out


def worker(name: str, out_dir: Path, flags: list[str]) -> int:
    from pdserve.planning.simulate import add_simulate_args, simulate

    p = argparse.ArgumentParser(prog=f"point {name}")
    add_simulate_args(p)
    m = simulate(p.parse_args(flags))
    (out_dir / f"{name}.json").write_text(json.dumps(compact(m, flags)))
    return 0


def run_all(
    args: argparse.Namespace,
    pending: list[tuple[str, list[str]]],
    running: dict[str, tuple[subprocess.Popen[bytes], float]],
    status: dict[str, str],
    start: float,
) -> None:
    """Start points as slots free up; past the deadline stop the running ones, skip the rest."""
    while pending or running:
        late = time.monotonic() - start > args.deadline_s
        while pending and len(running) < args.jobs and not late:
            name, flags = pending.pop(0)
            cmd = [sys.executable, "-m", "benchmarks.sim_farm", "--worker", name, str(args.out_dir)]
            log = open(args.out_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
            running[name] = (
                subprocess.Popen([*cmd, *flags], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT),
                time.monotonic(),
            )
        for name, (proc, t0) in list(running.items()):
            rc = proc.poll()
            if rc is None and late:
                proc.kill()
                rc = proc.wait()
                done = (args.out_dir / f"{name}.json").exists()  # it finished as the deadline passed
                status[name] = "ok" if done else "stopped at the deadline"
            if rc is not None:
                del running[name]
                status.setdefault(name, "ok" if rc == 0 else f"failed (rc {rc}, see {name}.log)")
                if rc == 0:
                    (args.out_dir / f"{name}.log").unlink(missing_ok=True)
                now = time.monotonic()
                print(
                    f"[{now - start:6.0f}s] {name}: {status[name]} in {now - t0:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )
        if late:
            for name, _ in pending:
                status[name] = "skipped (deadline)"
            pending.clear()
        time.sleep(0.2)


def main() -> int:
    # no abbreviations: a worker's simulate flags pass through parse_known_args untouched
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--points", type=Path)
    ap.add_argument("--out-dir", type=Path)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=float("inf"), help="stop everything after this")
    ap.add_argument("--worker", nargs=2, metavar=("NAME", "OUT_DIR"), help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.worker:
        return worker(args.worker[0], Path(args.worker[1]), rest)
    if rest or args.points is None or args.out_dir is None:
        ap.error("--points and --out-dir are required" + (f"; unknown: {' '.join(rest)}" if rest else ""))
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    points = parse_points(args.points.read_text())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, _ in points:  # a point not finished this run must not show an earlier run's result
        (args.out_dir / f"{name}.json").unlink(missing_ok=True)
    start = time.monotonic()
    pending = list(points)
    running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    status: dict[str, str] = {}
    try:
        run_all(args, pending, running, status, start)
    finally:  # an error or Ctrl-C here must not leave simulations running
        for proc, _ in running.values():
            proc.kill()
    summary: dict[str, Any] = {}
    for name, _ in points:
        f = args.out_dir / f"{name}.json"
        row: dict[str, Any] = {"status": status.get(name, "?")}
        if f.exists():
            m = json.loads(f.read_text())
            row.update({k: v for k, v in m.items() if k not in ("flags", "decisions")})
        summary[name] = row
    print(json.dumps({"points": summary, "wall_s": round(time.monotonic() - start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
