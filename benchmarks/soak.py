"""Soak: a 2 prefill + 2 decode deployment on a local Ray instance under mixed load for
``--minutes`` (default 10), one worker SIGKILLed a minute (the pool replaces it), while every
process is sampled; does anything grow?

Load: ``--clients`` threads, each sending one gRPC stream after another: prompts of 5, 40,
120, 300 or 600 tokens (``--random-lengths``: any length from 1 to 600, so that almost every
prefill step has a size of its own), 16-160 output tokens, greedy or seeded; one stream in five
is cancelled by the client after a few tokens; request ids are re-used (each client cycles
through four). Faults: at every full minute (``--kill-every``) a worker is SIGKILLed, decode
and prefill in turn.

Samples every ``--sample-s`` seconds (Linux ``/proc``): the router's process (this one) and
every live worker's RSS, open file descriptors and threads; KV blocks in use; the sizes of
every per-request map on every worker and in the router. Growth: the median of the last minute
minus the median of minute 2 (after warm-up), summed over the workers present, and
(``worker_rss_growth_mib``) for each worker present in both. After the load stops, blocks in
use and per-request state must be zero.

    .venv/bin/python -m benchmarks.soak                 # 10 minutes of load
    .venv/bin/python -m benchmarks.soak --minutes 3     # a quicker look
    .venv/bin/python -m benchmarks.soak --kill-every 0 --model smollm2-135m --random-lengths

The final JSON line has ``rss_growth_mib``, ``fd_growth``, ``threads_growth``,
``blocks_in_use_growth``, ``per_request_state_growth`` (router and workers), the same for the
router alone, the end-of-run leftovers and the request outcomes.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.chaos import start
from benchmarks.common import emit


@dataclass(frozen=True)
class Sample:
    t: float
    rss_mib: float
    anon_mib: float  # of rss_mib: private memory (heap); the rest is shared (the /dev/shm KV cache) and files
    fds: int
    threads: int
    blocks: int
    state: int
    router_rss_mib: float
    router_fds: int
    router_state: int
    worker_rss_mib: tuple[tuple[str, float, float], ...] = ()  # (worker id, RSS, anonymous RSS) each


def proc(pid: int) -> tuple[float, float, int, int]:
    """(RSS MiB, anonymous RSS MiB, open fds, threads) of a live process; zeros if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss, anon = (int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon"))
        return rss, anon, len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])
    except (FileNotFoundError, ProcessLookupError, KeyError):
        return 0.0, 0.0, 0, 0


def sample(st: Any, t0: float) -> Sample:
    from pdserve.worker.control import GetLoad, RequestState

    rss = anon = fds = threads = blocks = state = 0.0
    each: list[tuple[str, float, float]] = []
    for h in list(st.service.handles):
        if not h.alive:
            continue
        try:
            req = st.run(h.control(RequestState(), timeout_s=5), timeout_s=10)
            load = st.run(h.control(GetLoad(), timeout_s=5), timeout_s=10)
        except Exception:  # lost between the check and the call: counted next time
            continue
        r, a, f, n = proc(h.info.pid)
        rss, anon, fds, threads = rss + r, anon + a, fds + f, threads + n
        each.append((h.worker_id, r, a))
        blocks += load.kv_total - load.kv_free
        state += sum(req.values())
    me = proc(os.getpid())
    router = st.service.router
    rs = sum(st.run(_call(router.request_state)).values())
    t = time.monotonic() - t0
    return Sample(
        t, rss, anon, int(fds), int(threads), int(blocks), int(state), me[0], me[2], rs, tuple(each)
    )


def describe(s: Sample, outcomes: Counter[str]) -> str:
    return (
        f"{s.t:6.0f}s workers rss {s.rss_mib:7.1f} (anon {s.anon_mib:7.1f}) MiB fds {s.fds:4d} "
        f"threads {s.threads:4d} blocks {s.blocks:4d} state {s.state:3d} | router rss "
        f"{s.router_rss_mib:6.1f} MiB fds {s.router_fds:4d} state {s.router_state:3d} | {dict(outcomes)}"
    )


async def _call(fn: Any) -> Any:
    return fn()  # on the service's loop: the router's maps are that loop's


def client(
    stub: Any,
    idx: int,
    stop: threading.Event,
    outcomes: Counter[str],
    seed: int,
    random_lengths: bool = False,
) -> None:
    import grpc

    from pdserve.v1 import inference_pb2 as pb

    rng = random.Random(seed * 1000 + idx)
    i = 0
    while not stop.is_set():
        req = pb.GenerateRequest(stream=True, request_id=f"client-{idx}-{i % 4}")
        length = rng.randint(1, 600) if random_lengths else rng.choice([5, 40, 120, 300, 600])
        req.token_ids.ids.extend(rng.randrange(3, 256) for _ in range(length))
        req.sampling.max_tokens = rng.randrange(16, 161)
        req.sampling.ignore_eos = True
        if rng.random() < 0.5:
            req.sampling.temperature = 0.8
            req.sampling.seed = rng.randrange(1 << 31)
        else:
            req.sampling.temperature = 0.0
        cancel_after = rng.randrange(1, 8) if rng.random() < 0.2 else None
        i += 1
        call = stub.Generate(req, timeout=120)
        got = 0
        try:
            for msg in call:
                got += len(msg.chunk.token_ids)
                if cancel_after is not None and got >= cancel_after:
                    call.cancel()
                    break
            outcomes["cancelled" if cancel_after is not None and got >= cancel_after else "ok"] += 1
        except grpc.RpcError as e:
            code = e.code()
            outcomes["cancelled" if code == grpc.StatusCode.CANCELLED else f"error:{code.name}"] += 1


def growth(samples: list[Sample], key: str, end_s: float) -> float:
    return _growth([(s.t, getattr(s, key)) for s in samples], end_s)


def _growth(points: list[tuple[float, float]], end_s: float) -> float:
    """The median of the last minute minus the median of minute 2 (0 when either is empty)."""
    early = [v for t, v in points if 60 <= t < 120]
    late = [v for t, v in points if end_s - 60 <= t <= end_s]
    return float(statistics.median(late) - statistics.median(early)) if early and late else 0.0


def worker_growth(samples: list[Sample], end_s: float, anon: bool = False) -> dict[str, float]:
    """RSS growth (MiB; ``anon``: of anonymous memory) of each worker sampled both in minute 2
    and in the last minute."""
    series: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for wid, rss, anon_rss in s.worker_rss_mib:
            series.setdefault(wid, []).append((s.t, anon_rss if anon else rss))
    grown = {wid: _growth(points, end_s) for wid, points in series.items()}
    both = {wid for wid, pts in series.items() if any(60 <= t < 120 for t, _ in pts)
            and any(end_s - 60 <= t <= end_s for t, _ in pts)}  # fmt: skip
    return {wid: round(g, 1) for wid, g in sorted(grown.items()) if wid in both}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-every", type=float, default=60.0, metavar="S",
                    help="SIGKILL a worker every S seconds (0: never)")  # fmt: skip
    ap.add_argument("--model", default="tiny", help="the workers' model (default: the tiny test model)")
    ap.add_argument("--random-lengths", action="store_true", help="prompts of any length from 1 to 600")
    args = ap.parse_args()
    if args.minutes < 2.5:
        ap.error("--minutes must be >= 2.5 (growth is measured from minute 2)")

    from pdserve.deploy.ray_instance import start_ray

    start_ray(None, 16)
    st, stub = start(prefill=2, decode=2, model=args.model)
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    clients = [
        threading.Thread(
            target=client, args=(stub, i, stop, outcomes, args.seed, args.random_lengths), daemon=True
        )
        for i in range(args.clients)
    ]
    samples: list[Sample] = []
    kills: list[str] = []
    t0 = time.monotonic()
    duration = args.minutes * 60
    try:
        for c in clients:
            c.start()
        next_kill = args.kill_every if args.kill_every > 0 else float("inf")
        next_sample, role = 0.0, "decode"
        while (now := time.monotonic() - t0) < duration:
            if now >= next_sample:
                samples.append(sample(st, t0))
                s = samples[-1]
                print(describe(s, outcomes), file=sys.stderr)
                next_sample += args.sample_s
            if now >= next_kill and next_kill < duration - 30:
                victim = next((h for h in st.service.handles if h.alive and h.role.value == role), None)
                if victim is not None:
                    os.kill(victim.info.pid, signal.SIGKILL)
                    kills.append(victim.worker_id)
                    print(f"{now:6.0f}s SIGKILL {victim.worker_id}", file=sys.stderr)
                role = "prefill" if role == "decode" else "decode"
                next_kill += args.kill_every
            time.sleep(0.2)
        end = time.monotonic() - t0
        stop.set()
        for c in clients:
            c.join(180)
        time.sleep(2.0)  # aborts and frees settle
        final = sample(st, t0)
        keeper = st.service.keeper
        result = {
            "minutes": args.minutes,
            "model": args.model,
            "random_lengths": args.random_lengths,
            "clients": args.clients,
            "kills": kills,
            "replaced": keeper.replaced if keeper else 0,
            "outcomes": dict(outcomes),
            "rss_growth_mib": round(growth(samples, "rss_mib", end), 1),
            "anon_rss_growth_mib": round(growth(samples, "anon_mib", end), 1),
            "worker_rss_growth_mib": worker_growth(samples, end),
            "worker_anon_rss_growth_mib": worker_growth(samples, end, anon=True),
            "fd_growth": growth(samples, "fds", end),
            "threads_growth": growth(samples, "threads", end),
            "blocks_in_use_growth": growth(samples, "blocks", end),
            "per_request_state_growth": growth(samples, "state", end) + growth(samples, "router_state", end),
            "router_rss_growth_mib": round(growth(samples, "router_rss_mib", end), 1),
            "router_fd_growth": growth(samples, "router_fds", end),
            "end_blocks_in_use": final.blocks,
            "end_per_request_state": final.state + final.router_state,
            "workers_rss_mib": [round(samples[0].rss_mib, 1), round(final.rss_mib, 1)],
            "router_rss_mib": [round(samples[0].router_rss_mib, 1), round(final.router_rss_mib, 1)],
        }
        emit(result)
    finally:
        stop.set()
        st.stop()


if __name__ == "__main__":
    main()
