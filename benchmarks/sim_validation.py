"""The simulator against the real thing: `pdserve serve` on this CPU, swept for goodput, and
`pdserve simulate` with a profile fitted by `pdserve profile` on the same requests and rates.

In one run:

1. ``pdserve profile --model bench`` at 1 thread (a disaggregated worker's core) and at 2 threads
   (the colocated engine's two cores), each in a fresh process (or ``--profile-1t/--profile-2t``);
2. for each layout on the same 2 cores — **colocated**: one engine, ``--cpus-per-worker 2``;
   **disaggregated**: 1 prefill + 1 decode worker, one core each, KV over shm (as
   ``benchmarks/interference.py``), both routed by ``least_loaded`` as the simulator is — a
   calibration server with ``--step-log``: the unloaded latency (requests of the mean shape one
   at a time), for 1P+1D the co-activity probe (``benchmarks/coactivity.py``), a calibration
   load (Poisson at ``--calibration-rate``, a seed no sweep point uses) and a batch ladder
   (2, 4, 8 requests at once: decode steps of every batch size); then the
   SLO: TTFT <= ``--ttft-x`` x and TPOT <= ``--tpot-x`` x the better layout's unloaded median
   (Splitwise's portable form, field notes §2), one SLO for both layouts;
3. ``pdserve bench`` (the library, in this process) against each layout: Poisson arrivals,
   ``--num-prompts`` requests per point, the rate doubled from ``--min-rate`` until joint
   attainment falls below 90 %, then bisected ``--steps`` times, never below ``--rate-floor``
   (a point takes num-prompts / rate seconds); each point's per-request times and the sweep
   server's step log are kept in DIR for a look afterwards;
4. ``pdserve simulate`` with the layout's fitted profile on exactly the requests each real point
   sent (same lengths, same arrival times), and a simulated sweep of its own;
5. tables per layout and rate — attainment real / simulated (difference in points), median TTFT
   and TPOT real / simulated (difference in %), the load other jobs put on the host during the
   point — and both goodputs; first with the engine's profiles as fitted, then as the service
   runs them, from the calibration server's step logs only (``pdserve.simulator.service_fit``): the
   workers' measured steps against the profile (a constant and a factor a step, by kind), the
   co-activity their steps show, and the serving worker's own cost per step beyond its forward
   pass (the real unloaded TPOT minus the simulated one, ``HostCalibration.step_overhead_s``),
   and how the steps scatter around all that (``pdserve.simulator.jitter``: each simulated point is
   the mean of ``--sim-seeds`` seeds of it); then once more with each point's profile set to
   the host's speed during that point, measured from the sweep server's step log
   (``benchmarks/point_speed.py``: two medians a point, by step kind). Targets: 5 points and
   15 %. Last line: JSON.

The host is a 2-core VM shared with other people's jobs: every measurement first waits (a few
minutes at most) for the rest of the host to be idle, and each point records how many cores
other jobs used while it ran.

    .venv/bin/python -m benchmarks.sim_validation --out-dir DIR              # ~1 hour on 2 cores
    .venv/bin/python -m benchmarks.sim_validation --resume DIR/real.json     # finish an interrupted run
    .venv/bin/python -m benchmarks.sim_validation --real-results DIR/real.json [--profile-2t P]  # re-simulate
                                                  # (re-fitting the service from DIR/steps when it is there)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import coactivity
from benchmarks.client import Server, start_pdserve
from benchmarks.common import emit
from benchmarks.point_speed import point_profiles
from pdserve.bench.client import PdserveGrpcBackend
from pdserve.bench.metrics import RequestResult
from pdserve.bench.runner import add_bench_args, bench, build_workload
from pdserve.bench.sweep import run_search, search
from pdserve.bench.workload import RequestSpec

BUDGET = 512
CALIBRATION_SEED = 1000  # added to --seed: the calibration load's requests are not a sweep point's
KV_MIB = 512
MAX_SEQS = 64
# The router policy is held the same on both sides: this validates the model of workers, steps
# and transfers, not a policy's decisions. It must be named on both, because their defaults
# differ: `pdserve serve` routes with `goodput`, which with no SLO class configured may prefill
# on the decode worker (conditional disaggregation) and so stall its batch for a whole prompt,
# while `pdserve simulate` defaults to `least_loaded`, which never does.
POLICY = ["--policy", "least_loaded"]
LAYOUTS: dict[str, dict[str, Any]] = {
    "colocated": {
        "serve": ["--colocated", "1", "--cpus-per-worker", "2", *POLICY],
        "sim": ["--colocated", "1", *POLICY],
        "threads": 2,
    },
    "disaggregated": {
        "serve": ["--prefill", "1", "--decode", "1", "--cpus-per-worker", "1", *POLICY],
        "sim": ["--prefill", "1", "--decode", "1", *POLICY],
        "threads": 1,
    },
}
KEYS = (
    "slo_attainment",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p90_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "request_throughput",
    "completed",
    "failed",
    "duration",
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class HostLoad:
    """CPU the rest of this shared host uses (cores): all busy time minus this process tree's
    (niced jobs too: a runnable thread on the other core stalls a 2-thread engine all the same).

    The machine is a 2-core VM other people's jobs run on; a point measured while they ran
    measures them too. Each point records the foreign load during it, and ``wait_quiet`` holds
    the next measurement back until the host has been quiet for a few seconds (at most a few
    minutes: then it measures anyway, and the table shows the load).
    """

    def __init__(self) -> None:
        self.root = os.getpid()
        self.hz = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return float(sum(v) - v[3] - v[4])  # all but idle and iowait

    def _mine(self) -> float:
        parent: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d)] = int(fields[1])
            # utime + stime, and cutime + cstime: children that already exited and were reaped
            # (a finished `pdserve profile`) leave /proc, and their time moves to their parent's
            cpu[int(d)] = float(sum(int(x) for x in fields[11:15]))
        total = 0.0
        for pid, t in cpu.items():
            q, hops = pid, 0
            while q > 1 and q != self.root and hops < 64:
                q, hops = parent.get(q, 0), hops + 1
            if q == self.root:
                total += t
        return total

    def sample(self) -> tuple[float, float, float]:
        return time.monotonic(), self._busy(), self._mine()

    def foreign(self, a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
        """Cores used by processes outside this tree between samples ``a`` and ``b``."""
        dt = b[0] - a[0]
        return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / self.hz / dt) if dt > 0 else 0.0

    def wait_quiet(self, limit: float = 0.3, window_s: float = 5.0, max_wait_s: float = 180.0) -> float:
        """Wait until the foreign load over ``window_s`` is <= ``limit`` cores; returns the load seen."""
        deadline = time.monotonic() + max_wait_s
        while True:
            a = self.sample()
            time.sleep(window_s)
            load = self.foreign(a, self.sample())
            if load <= limit or time.monotonic() > deadline:
                if load > limit:
                    log(f"  host still busy ({load:.2f} cores of other jobs); measuring anyway")
                return load
            log(f"  waiting for a quiet host: other jobs use {load:.2f} cores")


HOST = HostLoad()


def workload_flags(args: argparse.Namespace) -> list[str]:
    return (
        f"--random-input-len {args.input_len} --random-output-len {args.output_len} "
        f"--random-range-ratio {args.range_ratio} --num-prompts {args.num_prompts}"
    ).split()


def bench_ns(
    args: argparse.Namespace, port: str, rate: float, seed: int, slo: list[str]
) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    flags = f"--backend pdserve-grpc --port {port} --request-rate {rate} --seed {seed} --disable-tqdm".split()
    return p.parse_args([*flags, *workload_flags(args), *(["--goodput", *slo] if slo else [])])


def specs_for(args: argparse.Namespace, rate: float, seed: int) -> list[RequestSpec]:
    return build_workload(bench_ns(args, "0", rate, seed, []))


def simulate_point(
    layout: str, profile: str, specs: list[RequestSpec], slo: list[str], jitter_seed: int = 0
) -> dict[str, Any]:
    from pdserve.planning.simulate import add_simulate_args, simulate

    p = argparse.ArgumentParser()
    add_simulate_args(p)
    common = (
        f"--profile {profile} --max-num-batched-tokens {BUDGET} --max-num-seqs {MAX_SEQS} --block-size 16"
    )
    # every layout here runs on this one host (co-activity factors apply where the profile has them)
    flags = [*LAYOUTS[layout]["sim"], *common.split(), "--shared-host", "--jitter-seed", str(jitter_seed)]
    return simulate(p.parse_args([*flags, "--goodput", *slo]), specs)


MEAN_KEYS = ("slo_attainment", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def simulate_mean(
    layout: str, profile: str, specs: list[RequestSpec], slo: list[str], seeds: int
) -> dict[str, float]:
    """``simulate_point`` averaged over ``seeds`` seeds of the profile's step-time variability
    (one run where it has none: every seed would give the same)."""
    from pdserve.simulator.calibration import calibration_of, load_sim_profile

    varies = calibration_of(load_sim_profile(profile)).varies
    runs = [simulate_point(layout, profile, specs, slo, seed) for seed in range(seeds if varies else 1)]
    return {k: statistics.fmean(float(r[k]) for r in runs) for k in MEAN_KEYS}


def profile(threads: int, out: Path) -> Path:
    exe = str(Path(sys.executable).with_name("pdserve"))
    cmd = [exe, *f"profile --model bench --threads {threads} --kv-cache-mib {KV_MIB} --output {out}".split()]
    HOST.wait_quiet()
    log(f"$ {' '.join(cmd[1:])}")
    a = HOST.sample()
    subprocess.run(cmd, check=True)
    log(f"  (other jobs used {HOST.foreign(a, HOST.sample()):.2f} cores meanwhile)")
    return out


def lone_prompt(i: int, n: int) -> tuple[int, ...]:
    """The ``i``-th unloaded request's prompt: distinct per ``i`` (no prefix-cache hits)."""
    return tuple(16 + (i * 7919 + j * 31) % 240 for j in range(n))


async def unloaded(server: Server, args: argparse.Namespace, n: int = 6) -> dict[str, float]:
    """Median TTFT and TPOT of requests of the workload's mean shape sent one at a time."""
    backend = PdserveGrpcBackend(server.grpc, None, temperature=0.0)
    results: list[RequestResult] = []
    try:
        for i in range(n + 1):
            prompt = lone_prompt(i, args.input_len)
            r = await backend.send(RequestSpec(0.0, prompt, args.input_len, args.output_len))
            if i:  # the first warms up
                results.append(r)
    finally:
        await backend.close()
    ok = [r for r in results if r.success]
    if len(ok) < n:
        raise RuntimeError(f"unloaded requests failed: {[r.error for r in results if not r.success]}")
    return {
        "ttft_ms": statistics.median(r.ttft * 1000 for r in ok),
        "tpot_ms": statistics.median((r.tpot or 0.0) * 1000 for r in ok),
    }


def measure_coactivity(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """The two workers' slowdown of each other on this host (``benchmarks/coactivity.py``)."""
    HOST.wait_quiet()
    a = HOST.sample()
    longest = int(args.input_len * (1 + args.range_ratio))
    c = asyncio.run(coactivity.probe(server.grpc, args.input_len, longest))
    out = {**dataclasses.asdict(c), "foreign_cores": round(HOST.foreign(a, HOST.sample()), 2)}
    log(f"co-activity: {out}")
    return out


def service_fit(step_dir: Path, profile_path: str) -> dict[str, Any]:
    """The calibration traffic's step logs (the unloaded requests, for 1P+1D the co-activity
    probe, the calibration load and the batch ladder) against the engine's profile
    (``pdserve.simulator.service_fit``)."""
    from pdserve.model_runtime.engine.step_log import read_dir
    from pdserve.simulator.service_fit import fit_service
    from pdserve.steptime.fitted import FittedProfile
    from pdserve.steptime.load import load_profile

    prof = load_profile(profile_path)
    if not isinstance(prof, FittedProfile):
        return {}
    return dataclasses.asdict(fit_service(read_dir(step_dir), prof))


def calibration_load(server: Server, args: argparse.Namespace) -> None:
    """Poisson traffic of the workload's shape at ``--calibration-rate`` with a seed no sweep
    point uses: its step logs show the workers' steps under load (the in-service factors and
    co-activity); nothing else of it is kept."""
    n = max(30, min(60, args.num_prompts // 2))  # as many steps whatever the points' size
    port = server.grpc.rsplit(":", 1)[1]
    ns = bench_ns(args, port, args.calibration_rate, args.seed + CALIBRATION_SEED, [])
    ns.num_prompts = n
    HOST.wait_quiet()
    log(f"  calibration load: {n} requests at {args.calibration_rate} req/s")
    asyncio.run(bench(ns))


LADDER = (2, 4, 8)  # requests sent at once, after the calibration load


def batch_ladder(server: Server, args: argparse.Namespace, base: dict[str, float]) -> None:
    """``k`` requests at once for each ``k`` in ``LADDER``, each decoding long enough to
    overlap all ``k`` prefills: decode steps of every batch size up to 8 in the step log, so the
    service fit can tell a constant per step from a factor (a calibration load at a low rate
    decodes mostly one request at a time)."""

    async def run() -> None:
        backend = PdserveGrpcBackend(server.grpc, None, temperature=0.0)
        j = 0
        try:
            for k in LADDER:
                out = args.output_len + int(k * base["ttft_ms"] / max(1.0, base["tpot_ms"]))
                specs = []
                for _ in range(k):
                    # 130 + 7j stays clear of every other calibration prompt (no cache hits)
                    n = args.input_len
                    specs.append(RequestSpec(0.0, lone_prompt(130 + 7 * j, n), n, out))
                    j += 1
                rs = await asyncio.gather(*(backend.send(s) for s in specs))
                failed = [r.error for r in rs if not r.success]
                if failed:
                    raise RuntimeError(f"batch ladder requests failed: {failed}")
        finally:
            await backend.close()

    HOST.wait_quiet()
    log(f"  batch ladder: {', '.join(map(str, LADDER))} requests at once")
    asyncio.run(run())


def serve(layout: str, step_log: Path | None = None) -> Server:
    common = (
        f"--model bench --max-num-batched-tokens {BUDGET} --max-num-seqs {MAX_SEQS} --kv-cache-mib {KV_MIB}"
    )
    flags = [*common.split(), *LAYOUTS[layout]["serve"], *(["--step-log", str(step_log)] if step_log else [])]
    log(f"{layout}: pdserve serve {' '.join(flags)}")
    return start_pdserve(*flags)


def bisect(measure: Callable[[float], float], args: argparse.Namespace) -> dict[str, Any]:
    """``pdserve bench --sweep``'s search (double from ``--min-rate`` until attainment < 90 %, then
    ``--steps`` bisections), except that rates under ``--rate-floor`` are not measured: a point
    takes ``--num-prompts`` / rate seconds, so a goodput below the floor is reported as such."""
    found = run_search(
        search(args.min_rate, 6, args.steps, stop=lambda hi, mid: mid < args.rate_floor), measure
    )
    return {
        "goodput_rate": found.goodput,
        "bracketed": found.bracketed,
        "failed_at": found.failed_at,
        "floored": found.stopped,
    }


def real_sweep(
    layout: str,
    args: argparse.Namespace,
    slo: list[str],
    save: Any,
    done: list[dict[str, Any]],
    raw_dir: Path,
) -> dict[str, Any]:
    """The real sweep; points already in ``done`` (an interrupted run of the same SLO) are reused.
    Each point's per-request times go to ``raw_dir`` (``pdserve bench --save-result``'s fields)
    for a look at where the simulator and the service part."""
    points: list[dict[str, Any]] = list(done)
    server: Server | None = None
    try:

        def measure(rate: float) -> float:
            nonlocal server
            for pt in points:
                if abs(pt["rate"] - rate) < 1e-9:
                    return float(pt["slo_attainment"])
            if server is None:  # its step log is for a look afterwards, never for calibration
                server = serve(layout, raw_dir / "steps" / f"{layout}-sweep")
            port = server.grpc.rsplit(":", 1)[1]
            HOST.wait_quiet()
            t0, a, mono0 = time.perf_counter(), HOST.sample(), time.monotonic()
            m = asyncio.run(bench(bench_ns(args, port, rate, args.seed, slo)))
            foreign = round(HOST.foreign(a, HOST.sample()), 2)
            row = {
                "rate": rate,
                "seed": args.seed,
                **{k: m[k] for k in KEYS},
                "wall_s": time.perf_counter() - t0,
                "foreign_cores": foreign,
                "mono": [mono0, time.monotonic()],  # the workers' step-log clock: this point's steps
            }
            points.append(row)
            save(layout, points)
            raw = {k: m[k] for k in ("ttfts", "itls", "input_lens", "output_lens", "errors")}
            (raw_dir / f"{layout}-{rate:.3f}.json").write_text(json.dumps(raw))
            log(
                f"  {layout} real {rate:6.3f} req/s: attainment {m['slo_attainment']:.3f}, "
                f"TTFT p50 {m['median_ttft_ms']:.0f} ms, TPOT p50 {m['median_tpot_ms']:.1f} ms, "
                f"other jobs {foreign:.2f} cores"
            )
            return float(m["slo_attainment"])

        res = bisect(measure, args)
    finally:
        if server is not None:
            server.stop()
    return {**res, "points": points}


def sim_sweep(layout: str, prof: str, args: argparse.Namespace, slo: list[str]) -> dict[str, Any]:
    def measure(rate: float) -> float:
        specs = specs_for(args, rate, args.seed)
        return simulate_mean(layout, prof, specs, slo, args.sim_seeds)["slo_attainment"]

    return bisect(measure, args)


def pct(sim: float, real: float) -> float:
    return (sim - real) / real * 100 if real else float("nan")


def calibrate(
    real: dict[str, Any], profiles: dict[str, str], args: argparse.Namespace, out_dir: Path
) -> dict[str, str]:
    """Each layout's profile as the service runs it, from calibration traffic only (never the
    sweep's points): the engine's steps as the workers' step logs measured them and the
    co-activity they show (``real["service_fit"]``; runs that predate step logs keep the
    engine's steps and take co-activity from the client-side probe), then the serving worker's
    own cost per step beyond its forward pass: the real unloaded TPOT minus the simulator's for
    the same lone requests."""
    from pdserve.simulator.calibration import Calibrated, HostCalibration
    from pdserve.steptime.fitted import FittedProfile
    from pdserve.steptime.load import load_profile

    out: dict[str, str] = {}
    for layout, base in real["unloaded"].items():
        engine = load_profile(profiles[layout])
        if not isinstance(engine, FittedProfile):
            out[layout] = profiles[layout]
            continue
        fit = real.get("service_fit", {}).get(layout)
        if fit:
            prof = Calibrated(engine, HostCalibration(**fit["calibration"]))
        else:
            co = real.get("coactivity", {}) if layout == "disaggregated" else {}
            probed = {k: co.get(k, 1.0) for k in ("prefill_coactive_x", "decode_coactive_x")}
            prof = Calibrated(engine, HostCalibration(**probed))
        scaled = out_dir / f"{prof.name}-{layout}-steps.json"
        scaled.write_text(prof.to_json() + "\n")
        n = args.input_len
        lone = [RequestSpec(30.0 * i, lone_prompt(i + 1, n), n, args.output_len) for i in range(6)]
        sim = simulate_mean(layout, str(scaled), lone, real["slo"], args.sim_seeds)
        overhead = max(0.0, (base["tpot_ms"] - sim["median_tpot_ms"]) / 1000)
        cal = prof.with_calibration(dataclasses.replace(prof.calibration, step_overhead_s=overhead))
        path = out_dir / f"{cal.name}-{layout}.json"
        path.write_text(cal.to_json() + "\n")
        again = simulate_mean(layout, str(path), lone, real["slo"], args.sim_seeds)
        print(
            f"{layout} unloaded: TPOT real {base['tpot_ms']:.2f} ms, model {sim['median_tpot_ms']:.2f} ms"
            f" -> service overhead {overhead * 1000:.2f} ms/step; TTFT real {base['ttft_ms']:.1f} ms, model"
            f" {sim['median_ttft_ms']:.1f} ms without it, {again['median_ttft_ms']:.1f} ms with it;"
            f" in-service steps: {'as in the step logs' if fit else 'as profiled'};"
            f" co-activity: decode x{cal.calibration.decode_coactive_x:.2f},"
            f" prefill x{cal.calibration.prefill_coactive_x:.2f}"
        )
        out[layout] = str(path)
    return out


def compare(
    real: dict[str, Any],
    profiles: dict[str, str],
    args: argparse.Namespace,
    title: str = "",
    own_profiles: dict[str, dict[float, str]] | None = None,
) -> dict[str, Any]:
    """Each real point against the simulator on the same requests (averaged over
    ``--sim-seeds`` seeds of step-time variability), and both goodputs. ``own_profiles``: a
    profile per real point (layout -> rate -> path) in place of the layout's; the simulated
    goodput sweep is then left out (no other rate has a measured speed)."""
    slo = real["slo"]
    out: dict[str, Any] = {}
    print(
        f"\n{title}\nSLO: {' '.join(slo)} (joint); {args.num_prompts} requests per point, one seed; "
        f"simulated: mean of {args.sim_seeds} seeds of step-time variability where the profile has it"
    )
    hdr = (
        f"{'layout':<14} {'rate':>6} | {'attainment real/sim':>20} {'Δ pp':>6} | "
        f"{'TTFT p50 real/sim ms':>22} {'Δ %':>6} | {'TPOT p50 real/sim ms':>21} {'Δ %':>6} | other jobs"
    )
    print(hdr)
    print("-" * len(hdr))
    worst: dict[str, float] = {"att_pp": 0.0, "ttft_pct": 0.0, "tpot_pct": 0.0}
    for layout, res in real["layouts"].items():
        rows = []
        own = (own_profiles or {}).get(layout, {})
        for pt in sorted(res["points"], key=lambda r: r["rate"]):
            prof = own.get(pt["rate"], profiles[layout])
            sim = simulate_mean(layout, prof, specs_for(args, pt["rate"], pt["seed"]), slo, args.sim_seeds)
            d_att = (sim["slo_attainment"] - pt["slo_attainment"]) * 100
            d_ttft = pct(sim["median_ttft_ms"], pt["median_ttft_ms"])
            d_tpot = pct(sim["median_tpot_ms"], pt["median_tpot_ms"])
            att = f"{pt['slo_attainment']:9.3f} / {sim['slo_attainment']:.3f} {d_att:+6.1f}"
            ttft = f"{pt['median_ttft_ms']:10.1f} / {sim['median_ttft_ms']:9.1f} {d_ttft:+6.1f}"
            tpot = f"{pt['median_tpot_ms']:9.2f} / {sim['median_tpot_ms']:9.2f} {d_tpot:+6.1f}"
            busy = pt.get("foreign_cores", "-")
            print(f"{layout:<14} {pt['rate']:6.3f} | {att} | {ttft} | {tpot} | {busy}")
            rows.append(
                {
                    "rate": round(pt["rate"], 3),
                    "attainment": [round(pt["slo_attainment"], 3), round(sim["slo_attainment"], 3)],
                    "median_ttft_ms": [round(pt["median_ttft_ms"], 1), round(sim["median_ttft_ms"], 1)],
                    "median_tpot_ms": [round(pt["median_tpot_ms"], 2), round(sim["median_tpot_ms"], 2)],
                    "p99_tpot_ms": [round(pt["p99_tpot_ms"], 2), round(sim["p99_tpot_ms"], 2)],
                }
            )
            worst["att_pp"] = max(worst["att_pp"], abs(d_att))
            worst["ttft_pct"] = max(worst["ttft_pct"], abs(d_ttft))
            worst["tpot_pct"] = max(worst["tpot_pct"], abs(d_tpot))
        out[f"{layout}_points"] = rows
        if own_profiles is not None:
            continue
        sim_good = sim_sweep(layout, profiles[layout], args, slo)
        out[f"{layout}_goodput_real_rps"] = round(res.get("goodput_rate", float("nan")), 3)
        out[f"{layout}_goodput_below_floor"] = [bool(res.get("floored")), bool(sim_good["floored"])]
        out[f"{layout}_goodput_sim_rps"] = round(sim_good["goodput_rate"], 3)
        out[f"{layout}_bracketed"] = [res.get("bracketed"), sim_good["bracketed"]]
    print("\ngoodput (req/s at >= 90 % attainment), real / simulated:" if own_profiles is None else "")
    for layout in real["layouts"] if own_profiles is None else ():
        r, s = out[f"{layout}_goodput_real_rps"], out[f"{layout}_goodput_sim_rps"]
        below = ["(< floor)" if f else "" for f in out[f"{layout}_goodput_below_floor"]]
        print(f"  {layout:<14} {r:6.3f}{below[0]} / {s:6.3f}{below[1]}")
    out.update({f"max_abs_{k}": round(v, 1) for k, v in worst.items()})
    out["targets_met"] = worst["att_pp"] <= 5 and worst["ttft_pct"] <= 15 and worst["tpot_pct"] <= 15
    return out


WORKLOAD_KEYS = (
    "input_len",
    "output_len",
    "range_ratio",
    "num_prompts",
    "min_rate",
    "steps",
    "seed",
    "rate_floor",
    "calibration_rate",
)


def measure_real(
    args: argparse.Namespace, out_dir: Path, layouts: list[str]
) -> tuple[dict[str, Any], dict[str, str], Path]:
    """Profiles, unloaded latencies, the SLO, then each layout's real sweep (or, with
    ``--resume``, whatever an interrupted run had not finished, with its SLO and workload)."""
    if args.resume:
        path = args.resume
        real = json.loads(path.read_text())
        for k, v in real["workload"].items():
            setattr(args, k, v)
        profiles = dict(real["profiles"])
        for name, spec in LAYOUTS.items():
            given = args.profile_1t if spec["threads"] == 1 else args.profile_2t
            profiles[name] = given or profiles[name]
        real["profiles"] = profiles
    else:
        path = out_dir / "real.json"
        t0 = time.perf_counter()
        p1 = args.profile_1t or str(profile(1, out_dir / "cpu-bench-1t.json"))
        p2 = args.profile_2t or str(profile(2, out_dir / "cpu-bench-2t.json"))
        profiles = {name: (p1 if LAYOUTS[name]["threads"] == 1 else p2) for name in LAYOUTS}
        log(f"profiles ready in {time.perf_counter() - t0:.0f}s")
        base: dict[str, dict[str, float]] = {}
        coact: dict[str, Any] = {}
        fits: dict[str, Any] = {}
        for layout in layouts:
            steps = out_dir / "steps" / f"{layout}-calibration"
            server = serve(layout, steps)
            try:
                HOST.wait_quiet()
                base[layout] = asyncio.run(unloaded(server, args))
                if layout == "disaggregated":
                    coact = measure_coactivity(server, args)
                calibration_load(server, args)
                batch_ladder(server, args, base[layout])
            finally:
                server.stop()
            log(f"{layout} unloaded: {base[layout]}")
            fits[layout] = service_fit(steps, profiles[layout])
            log(f"{layout} steps in the service against the engine's profile: {fits[layout]}")
        ttft = args.ttft_x * min(b["ttft_ms"] for b in base.values())
        tpot = args.tpot_x * min(b["tpot_ms"] for b in base.values())
        slo = [f"ttft:{ttft:.0f}", f"tpot:{tpot:.1f}"]
        log(f"SLO: {' '.join(slo)}")
        workload = {k: getattr(args, k) for k in WORKLOAD_KEYS}
        real = {
            "profiles": profiles,
            "unloaded": base,
            "service_fit": fits,
            "slo": slo,
            "workload": workload,
            "layouts": {},
        }
        if coact:
            real["coactivity"] = coact

    def save(layout: str, points: list[dict[str, Any]]) -> None:
        real["layouts"].setdefault(layout, {"points": []})["points"] = points
        path.write_text(json.dumps(real, indent=1))

    for layout in layouts:
        prior = real["layouts"].get(layout, {})
        if "goodput_rate" in prior:
            continue
        res = real_sweep(layout, args, real["slo"], save, prior.get("points", []), path.parent)
        real["layouts"][layout] = res
        path.write_text(json.dumps(real, indent=1))
        log(f"{layout}: real goodput {res['goodput_rate']:.3f} req/s")
    return real, profiles, path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile-1t", default=None, help="fitted profile JSON for 1 thread (else measured)")
    p.add_argument("--profile-2t", default=None, help="fitted profile JSON for 2 threads (else measured)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--min-rate", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=3, help="bisection steps after bracketing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-x", type=float, default=3.0, help="TTFT SLO as a multiple of unloaded")
    p.add_argument("--tpot-x", type=float, default=1.5, help="TPOT SLO as a multiple of unloaded")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument(
        "--calibration-rate",
        type=float,
        default=0.5,
        help="req/s of the calibration load whose step logs calibrate the profiles (not a sweep point)",
    )
    p.add_argument("--rate-floor", type=float, default=0.2, help="rates below this are not measured (req/s)")
    p.add_argument(
        "--sim-seeds",
        type=int,
        default=5,
        help="seeds of the calibrated profile's step-time variability each simulated point averages",
    )
    p.add_argument("--real-results", type=Path, default=None, help="skip the real runs: re-simulate these")
    p.add_argument("--resume", type=Path, default=None, help="continue an interrupted run from its real.json")
    p.add_argument(
        "--measure-coactivity",
        action="store_true",
        help="with --real-results: probe the disaggregated service's co-activity now and use it",
    )
    args = p.parse_args()
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="pdserve-simval-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    layouts = args.layouts.split(",")

    if args.real_results:
        real = json.loads(args.real_results.read_text())
        profiles = dict(real["profiles"])
        for name, spec in LAYOUTS.items():  # profiles given on the command line replace the run's
            given = args.profile_1t if spec["threads"] == 1 else args.profile_2t
            profiles[name] = given or profiles[name]
        for k, v in real.get("workload", {}).items():
            setattr(args, k, v)
        if args.measure_coactivity:
            server = serve("disaggregated")
            try:
                real["coactivity"] = measure_coactivity(server, args)
            finally:
                server.stop()
            (out_dir / "real.json").write_text(json.dumps(real, indent=1))
            log(f"real results with co-activity in {out_dir / 'real.json'}")
        steps = args.real_results.parent / "steps"
        for layout in real["unloaded"]:  # the fit again, as this code fits the run's own logs
            if (steps / f"{layout}-calibration").is_dir():
                real.setdefault("service_fit", {})[layout] = service_fit(
                    steps / f"{layout}-calibration", profiles[layout]
                )
                log(f"{layout} service fit from {steps}: {real['service_fit'][layout]}")
        steps_root = steps
    else:
        real, profiles, path = measure_real(args, out_dir, layouts)
        log(f"real results in {path}")
        steps_root = path.parent / "steps"
    engine_only = compare(
        real, profiles, args, "== simulator with the engine's fitted profiles (pdserve profile)"
    )
    calibrated = calibrate(real, profiles, args, out_dir)
    result = compare(real, calibrated, args, "== as the service runs them (step-log fit, per-step overhead)")
    result["engine_only"] = {k: v for k, v in engine_only.items() if not k.endswith("_points")}
    result["calibrated_profiles"] = calibrated
    speed, noise, host = point_profiles(real, calibrated, steps_root, out_dir, args.num_prompts)
    if speed:
        title = "== at each point's own host speed (measured from the sweep's step log)"
        result["at_point_speed"] = {**compare(real, calibrated, args, title, speed), "host_speed": host}
        title = "== at each point's own host speed and step-time scatter (both from the sweep's step log)"
        result["at_point_speed_and_scatter"] = {**compare(real, calibrated, args, title, noise), "host": host}
    result.update(
        {
            "slo": " ".join(real["slo"]),
            "unloaded": real.get("unloaded"),
            "coactivity": real.get("coactivity"),
            "profiles": profiles,
            "num_prompts": args.num_prompts,
        }
    )
    emit(result)


if __name__ == "__main__":
    main()
