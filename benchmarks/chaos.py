"""Chaos: a real 2 prefill + 2 decode deployment, 16 concurrent greedy streams of mixed lengths
checked token by token against HF transformers, one fault per scenario; what a client sees.

Scenarios (each on a fresh deployment on a local Ray instance, lost workers replaced as the
product does by default; the test suite runs them on one deployment, whole again before each):
``none``; ``decode_kill`` SIGKILL of a decode worker mid-stream; ``prefill_kill`` SIGKILL of a
prefill worker with prompts queued (mid-prefill); ``prefill_push_kill`` SIGKILL of a prefill
worker the moment the first stream has its first token (its KV pushes under way);
``decode_stop`` SIGSTOP of a decode worker for 5 s; ``decode_term`` SIGTERM of a decode worker
mid-stream (it drains); ``shrink_then_crash`` the decode worker holding more streams retired
mid-stream (``Membership.retire``, as ``Service.resize`` does; a 2 s drain) and the other SIGKILLed
0.3 s into the drain (the retirement must be given up); ``kv_drop`` every KV connection to the
decode workers reset (``ss -K``) for 1.5 s while prompts are prefilled, and on until a transfer
is seen dropped (at most 10 s); ``kv_listener_flood`` 300 idle connections that never
authenticate held open to each decode worker's KV listener by another process, reopened as they
close, for the whole run, the senders' connections from before it reset (``ss -K``) before the
streams start, so that every hand-off connects through the flood (each must succeed);
``router_term`` SIGTERM of the router (``pdserve serve --local`` in a child process; it drains);
``group_sigterm`` SIGTERM to the process group of a ``pdserve serve`` on its own private Ray
instance (``kill -TERM -- -PGID``: Ray's processes must not get it; it drains and stops in
order, leaving no process of its session behind).

Per scenario: streams succeeded / failed, streams migrated, tokens lost (a stream shorter than
its reference, or different from it) and duplicated (longer), KV blocks still in use after the
traffic on the live workers and their per-request map entries, detection time (fault -> the
router stops routing to the worker), recovery time (fault -> the last moved stream's first token
after that), KV transfers failed, and TTFT p50/p99 of the streams started before the fault and
of a second wave of 8 started right after it (``router_term``: those must be refused).

    .venv/bin/python -m benchmarks.chaos            # about 6 minutes on 2 cores
    .venv/bin/python -m benchmarks.chaos --scenarios none,decode_kill

The final JSON line totals ``failed``, ``tokens_lost``, ``tokens_duplicated`` and
``blocks_leaked`` over all scenarios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from benchmarks import flood
from benchmarks.common import emit

SCENARIOS = ("none", "decode_kill", "prefill_kill", "prefill_push_kill", "decode_stop", "decode_term",
             "shrink_then_crash", "kv_drop", "kv_listener_flood", "router_term", "group_sigterm",
             "router_kill")  # fmt: skip
SERVE_ALONE = ("router_term", "group_sigterm")  # a ``pdserve serve`` of their own
REPLICATED = ("router_kill",)  # a deployment of their own, with router replicas (``chaos_routers``)
SIGNALS = {"decode_kill": signal.SIGKILL, "prefill_kill": signal.SIGKILL, "prefill_push_kill": signal.SIGKILL,
           "decode_stop": signal.SIGSTOP, "decode_term": signal.SIGTERM,
           "shrink_then_crash": signal.SIGKILL}  # fmt: skip
MID_STREAM = ("decode_kill", "decode_stop", "decode_term", "shrink_then_crash")
ENGINE_FLAGS = ["--block-size", "16", "--max-num-batched-tokens", "256", "--max-num-seqs", "32"]


@dataclass
class StreamLog:
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    start: float = 0.0
    migrations: int = 0
    error: str = ""
    code: str = ""  # the gRPC status code name of a failed stream
    router: str = ""  # the router replica that served it (``chaos_routers``)


@dataclass(frozen=True)
class Work:
    """The streams of a scenario: those started before the fault, and a wave right after it."""

    before: list[tuple[list[int], int]]
    after: list[tuple[list[int], int]]
    refs_before: list[list[int]]
    refs_after: list[list[int]]


def reference(model: Any, prompt: list[int], n: int) -> list[int]:
    """HF greedy continuation (EOS ignored), with the model's own KV cache."""
    import torch

    from tests.engine.hf_models import hf_greedy

    with torch.no_grad():
        return hf_greedy(model, prompt, n)[0]


def workload(seed: int, n: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, 256) for _ in range(rng.choice([5, 40, 120, 300, 600]))],
            rng.choice([48, 96, 160]),
        )
        for _ in range(n)
    ]


def make_work(seed: int, streams: int, after: int) -> Work:
    import transformers

    from pdserve.model_runtime.presets import resolve_model

    model = transformers.AutoModelForCausalLM.from_pretrained(str(resolve_model("tiny").path)).eval()
    before_w, after_w = workload(seed, streams), workload(seed + 1, after)
    return Work(before_w, after_w, [reference(model, p, m) for p, m in before_w],
                [reference(model, p, m) for p, m in after_w])  # fmt: skip


def wait_for(cond: Any, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"not within {timeout_s}s: {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


def start(prefill: int, decode: int, model: str = "tiny") -> tuple[Any, Any]:
    """A deployment of ``model`` on the running Ray instance, with its gRPC stub."""
    import grpc

    from pdserve.deploy.pools import PoolSpec
    from pdserve.deploy.service import Service, ServiceThread
    from pdserve.model_runtime.config import CacheConfig, EngineConfig
    from pdserve.model_runtime.scheduler.plan import SchedulerConfig
    from pdserve.router.config import Caps, RouterConfig
    from pdserve.v1 import inference_pb2_grpc as pb_grpc

    engine = EngineConfig(model=model, cache=CacheConfig(block_size=16, num_blocks=512),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32))  # fmt: skip
    spec = PoolSpec(prefill=prefill, decode=decode, engine=engine)
    config = RouterConfig(
        http_port=0, grpc_port=0, caps=Caps(max_tokens=2048), model_name=model, local_prefill=False
    )
    st = ServiceThread(Service(spec, config, use_ray=True))
    ep = st.start()
    return st, pb_grpc.InferenceStub(grpc.insecure_channel(ep.grpc))


def stream_request(log: StreamLog) -> Any:
    """``log``'s greedy streamed request (EOS ignored)."""
    from pdserve.v1 import inference_pb2 as pb

    req = pb.GenerateRequest(stream=True)
    req.token_ids.ids.extend(log.prompt)
    req.sampling.max_tokens = log.max_tokens
    req.sampling.temperature = 0.0
    req.sampling.ignore_eos = True
    return req


def run_stream(stub: Any, log: StreamLog) -> None:
    req = stream_request(log)
    log.start = time.monotonic()
    try:
        for msg in stub.Generate(req, timeout=120):
            now = time.monotonic()
            for t in msg.chunk.token_ids:
                log.tokens.append(t)
                log.times.append(now)
            if msg.HasField("result"):
                log.migrations = msg.result.migrations
    except Exception as e:  # a failed request is a result here, not a crash
        details = e.details() if hasattr(e, "details") else str(e)
        log.code = e.code().name if hasattr(e, "code") else ""
        log.error = f"{type(e).__name__}: {details}"


def launch(stub: Any, work: list[tuple[list[int], int]]) -> tuple[list[StreamLog], list[threading.Thread]]:
    logs = [StreamLog(p, m) for p, m in work]
    threads = [threading.Thread(target=run_stream, args=(stub, lg)) for lg in logs]
    for t in threads:
        t.start()
    return logs, threads


def tally(logs: list[StreamLog], refs: list[list[int]]) -> tuple[int, int, int]:
    """(failed, tokens lost, tokens duplicated) of finished streams against their references."""
    lost = dup = failed = 0
    for lg, ref in zip(logs, refs, strict=True):
        failed += bool(lg.error)
        n_ok = next(
            (i for i, (a, b) in enumerate(zip(lg.tokens, ref, strict=False)) if a != b),
            min(len(lg.tokens), len(ref)),
        )
        lost += len(ref) - n_ok
        dup += max(0, len(lg.tokens) - len(ref))
    return failed, lost, dup


def percentiles(logs: list[StreamLog]) -> tuple[float | None, float | None]:
    ttfts = sorted((lg.times[0] - lg.start) * 1e3 for lg in logs if lg.times)
    if not ttfts:
        return None, None
    return round(statistics.median(ttfts), 1), round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1)


def kv_failures(st: Any) -> dict[str, int]:
    """KV transfers failed so far, by worker (each worker's count only grows)."""
    handles = [h for h in st.service.handles if h.load.transfers]
    return {h.worker_id: sum(n for _, n in h.load.transfers.failures) for h in handles}


def transfers_received(st: Any) -> int:
    """KV transfers the live decode workers have received so far (fresh loads)."""
    from pdserve.worker.control import GetLoad
    from pdserve.worker.messages import WorkerRole

    decode = [h for h in st.service.handles if h.alive and h.role is WorkerRole.DECODE]
    return sum(st.run(h.control(GetLoad(), timeout_s=10)).transfers.count for h in decode)


def kv_failed_since(st: Any, before: dict[str, int]) -> int:
    """KV transfers failed since ``kv_failures`` gave ``before``."""
    return sum(max(0, n - before.get(w, 0)) for w, n in kv_failures(st).items())


def whole(st: Any, prefill: int, decode: int) -> bool:
    """Every pool at its size, each worker routable (lost ones replaced, drained ones back)."""
    from pdserve.worker.messages import WorkerRole

    live = [h.role for h in st.service.handles if h.routable]
    return (live.count(WorkerRole.PREFILL), live.count(WorkerRole.DECODE)) == (prefill, decode)


def reset_kv_connections(
    addresses: list[str], seconds: float, dropped: Callable[[], bool] | None = None, most_s: float = 10.0
) -> int:
    """Reset every TCP connection to the decode workers' KV ports, again and again (``ss -K``,
    which needs CAP_NET_ADMIN), for ``seconds``, and on until ``dropped()`` says a transfer
    failed, at most ``most_s`` in all (the first transfers may begin after ``seconds``: a worker
    just replaced, a slow first step); returns how many resets ``ss`` reported."""
    resets = 0
    start = time.monotonic()
    while (now := time.monotonic()) < start + seconds or (
        dropped is not None and now < start + most_s and not dropped()
    ):
        for addr in addresses:
            host, _, port = addr.rpartition(":")
            out = subprocess.run(["ss", "-K", "-t", "dst", host, "dport", "=", f":{port}"],
                                 capture_output=True, text=True, check=False)  # fmt: skip
            resets += sum(1 for line in out.stdout.splitlines() if "ESTAB" in line)
        time.sleep(0.01)
    return resets


def scenario(name: str, work: Work, deployment: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """One fault on a fresh 2P+2D deployment, or on ``deployment`` (``start(2, 2)``'s, kept
    running: the scenario first waits for it to be whole again, and counts only its own KV
    failures)."""

    if name in SERVE_ALONE:
        return router_term(work, group=name == "group_sigterm")
    if name in REPLICATED:
        from benchmarks.chaos_routers import router_kill, start_replicated

        rst = start_replicated(prefill=2, decode=2)
        try:
            return router_kill(work, rst, rst.service.endpoints.grpc)
        finally:
            rst.stop()
    st, s = deployment if deployment is not None else start(prefill=2, decode=2)
    resume: threading.Timer | None = None
    flooding: subprocess.Popen[str] | None = None
    received_before = 0
    try:
        wait_for(lambda: whole(st, 2, 2), 120, "every pool whole (lost workers replaced)")
        kv_before = kv_failures(st)
        handles = {h.worker_id: h for h in st.service.handles if h.routable}
        if name == "kv_listener_flood":
            received_before = transfers_received(st)
            listeners = [h.info.address for h in handles.values() if h.info.address]
            # The senders' connections from before go (no transfer is in flight), so every
            # hand-off of the run needs a new connection, through the flood.
            reset_kv_connections(listeners, 0.05)
            flooding = flood.start(listeners, 300, seconds=300.0)
            flood.wait_ready(flooding)
            time.sleep(1.0)  # under way: every slot it can take, taken
        logs, threads = launch(s, work.before)
        if name == "prefill_kill":
            time.sleep(0.05)  # prompts queued, prefill under way
        elif name == "prefill_push_kill":
            wait_for(lambda: any(lg.tokens or lg.error for lg in logs), 60, "a first token")
        elif name in MID_STREAM:  # every stream has tokens
            wait_for(lambda: all(lg.tokens or lg.error for lg in logs), 60, "every stream started")
        shrink: Future[Any] | None = None
        held: dict[str, int] = {}
        victim: str | None
        if name == "shrink_then_crash":
            shrink, victim, held = shrink_decode_pool(st, handles)
        else:
            # The victim: the worker of its pool holding the most requests (the lowest id of a
            # tie), so that a fault mid-stream always has streams to move.
            pool = sorted(w for w, h in handles.items() if h.role.value == name.split("_")[0])
            victim = max(pool, key=lambda w: len(handles[w].inflight)) if name in SIGNALS else None
        t_fault = time.monotonic()
        detected = 0.0
        if victim is not None:
            pid = handles[victim].info.pid
            os.kill(pid, SIGNALS[name])
        after_logs, after_threads = launch(s, work.after)
        if victim is not None:
            # Detected: the router routes nothing more to it (lost, or draining on SIGTERM).
            detected = wait_for(lambda: not handles[victim].routable, 30, f"{victim} seen lost")
            if name == "decode_stop":
                resume = threading.Timer(max(0.0, 5.0 - detected), lambda: _cont(pid))
                resume.start()
        if name == "kv_drop":
            addresses = [h.info.address for h in handles.values() if h.info.address]
            reset_kv_connections(addresses, 1.5, lambda: kv_failed_since(st, kv_before) > 0)
        for t in threads + after_threads:
            t.join(180)
        extra: dict[str, Any] = {"held_at_shrink": held, "victim": victim} if held else {}
        if flooding is not None:
            extra["flood"] = flood.result(flooding)
            extra["handoffs"] = transfers_received(st) - received_before
        given_up = None
        if shrink is not None:
            change = shrink.result(60)
            given_up = not change.done
            if change.done:
                restore_decode_pool(st, 2)
        failed, lost, dup = tally(logs + after_logs, work.refs_before + work.refs_after)
        moved = [lg for lg in logs + after_logs if lg.migrations]
        seen = t_fault + detected  # tokens before this may still be the lost worker's
        recovery = max((next((t for t in lg.times if t > seen), seen) - t_fault for lg in moved), default=0.0)
        time.sleep(1.0)  # aborts and frees settle
        leaked, state_left = leftovers(st)
        kv_failed = kv_failed_since(st, kv_before)
        r = row(name, logs + after_logs, failed, lost, dup, leaked, state_left, detected, recovery,
                kv_failed, percentiles(logs), percentiles(after_logs), len(moved))  # fmt: skip
        if given_up is not None:
            r["shrink_given_up"] = given_up
        return {**r, **extra}
    finally:
        if flooding is not None and flooding.poll() is None:
            flooding.kill()
        if resume is not None:
            resume.join()  # the stopped process resumed (or already gone) before the next fault
        if deployment is None:
            st.stop()


def leftovers(st: Any) -> tuple[int, int]:
    """(KV blocks in use, per-request entries) on the deployment's live workers."""
    from pdserve.worker.control import GetLoad, RequestState

    leaked = state_left = 0
    for h in st.service.handles:
        if h.alive:
            state = st.run(h.control(RequestState(), timeout_s=10))
            load = st.run(h.control(GetLoad(), timeout_s=10))
            leaked += load.kv_total - load.kv_free  # blocks in use (cached ones count as free)
            state_left += sum(state.values())
    return leaked, state_left


def shrink_decode_pool(st: Any, handles: dict[str, Any]) -> tuple[Future[Any], str, dict[str, int]]:
    """Retire one of the two decode workers with a 2 s drain (``Membership.retire``, what
    ``Service.resize`` does for the autoscaler), the one holding more streams, so that it is
    still draining when, 0.3 s in, the other one (the victim) is killed; the victim's streams,
    if the router placed any there, must move to it. Returns the retirement (its
    ``PoolChange``), the victim, and the streams each worker held."""
    from pdserve.worker.messages import WorkerRole

    decode = [h for h in handles.values() if h.role is WorkerRole.DECODE]
    held = {h.worker_id: len(h.inflight) for h in decode}
    leaving = max(decode, key=lambda h: (len(h.inflight), h.worker_id))
    if not leaving.inflight:
        raise RuntimeError(f"shrink_then_crash needs streams on a decode worker, held: {held}")
    router = st.service.router
    shrink = asyncio.run_coroutine_threadsafe(router.membership.retire(leaving.worker_id, 2.0), st.loop)
    wait_for(lambda: leaving.retiring, 10, "a decode worker draining to retire")
    time.sleep(0.3)
    [kept] = [h for h in decode if h is not leaving]
    return shrink, kept.worker_id, held


def restore_decode_pool(st: Any, size: int) -> None:
    """After a retirement that was not given up: the decode pool back to ``size``."""
    from pdserve.worker.messages import WorkerRole

    st.service.handles = [h for h in st.service.handles if h.worker_id in st.service.router.workers]
    asyncio.run_coroutine_threadsafe(st.service.resize(WorkerRole.DECODE, size), st.loop).result(120)


def router_term(work: Work, group: bool = False) -> dict[str, Any]:
    """``pdserve serve --local`` in a child process, SIGTERM once every stream has tokens: the
    streams must finish, the wave after it be refused (UNAVAILABLE), the process exit cleanly.
    ``group``: ``pdserve serve`` on a private Ray instance, in a session of its own, and the
    SIGTERM to its whole process group; no process of that session may outlive it."""
    import grpc
    import psutil

    from pdserve.v1 import inference_pb2_grpc as pb_grpc

    ports = [_free_port(), _free_port()]
    cmd = [sys.executable, "-m", "pdserve", "serve", *([] if group else ["--local"]), "--model", "tiny",
           "--prefill", "2", "--decode", "2", "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
           "--no-local-prefill", *ENGINE_FLAGS]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=group
    )
    out: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if "ready in" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    exit_s = 0.0
    try:
        if not ready.wait(180):
            raise RuntimeError("pdserve serve did not start:\n" + "".join(out[-20:]))
        s = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{ports[1]}"))
        logs, threads = launch(s, work.before)
        wait_for(lambda: all(lg.tokens or lg.error for lg in logs), 60, "every stream started")
        t_signal = time.monotonic()
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        wait_for(lambda: any("draining" in line for line in out), 10, "the router draining")
        after_logs, after_threads = launch(s, work.after)
        for t in threads + after_threads:
            t.join(180)
        code = proc.wait(120)
        exit_s = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [p.pid for p in psutil.process_iter(["pid"]) if _session(p) == proc.pid] if group else []
    failed, lost, dup = tally(logs, work.refs_before)
    refused = sum(lg.code == "UNAVAILABLE" and not lg.tokens for lg in after_logs)
    clean = code == 0 and any(line.strip() == "pdserve: stopped" for line in out)
    if not clean:
        print(f"pdserve serve exited {code}:\n" + "".join(out[-30:]), file=sys.stderr)
    name = "group_sigterm" if group else "router_term"
    r = row(name, logs, failed, lost, dup, None, None, 0.0, 0.0, 0, percentiles(logs), (None, None),
            0)  # fmt: skip
    r.update(refused_after=refused, after=len(after_logs), clean_exit=clean, exit_s=round(exit_s, 2))
    if group:
        r["processes_left"] = len(left)
    r["failed"] += len(after_logs) - refused  # a request after the signal must be refused, at once
    return r


def _session(p: Any) -> int:
    try:
        return os.getsid(p.pid)
    except OSError:  # gone meanwhile
        return -1


def row(name: str, logs: list[StreamLog], failed: int, lost: int, dup: int, leaked: int | None,
        state_left: int | None, detected: float, recovery: float, kv_failed: int,
        before: tuple[float | None, float | None], after: tuple[float | None, float | None],
        migrated: int) -> dict[str, Any]:  # fmt: skip
    return {
        "scenario": name, "succeeded": len(logs) - failed, "failed": failed, "migrated": migrated,
        "tokens_lost": lost, "tokens_duplicated": dup, "blocks_leaked": leaked, "state_left": state_left,
        "detection_s": round(detected, 3), "recovery_s": round(recovery, 3), "kv_failed": kv_failed,
        "ttft_before_ms": before, "ttft_after_ms": after,
        "errors": sorted({lg.error for lg in logs if lg.error})[:3],
    }  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the router already stopped it for good
        os.kill(pid, signal.SIGCONT)


def run(names: list[str], streams: int, after: int, seed: int) -> list[dict[str, Any]]:
    from pdserve.deploy.ray_instance import start_ray

    work = make_work(seed, streams, after)
    rows = []
    for name in [n for n in names if n in SERVE_ALONE]:  # before this process starts Ray
        rows.append(scenario(name, work))
        print(rows[-1], file=sys.stderr)
    start_ray(None, 16)
    for name in names:
        if name not in SERVE_ALONE:
            print(f"scenario {name} ...", file=sys.stderr)
            rows.append(scenario(name, work))
            print(rows[-1], file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--after", type=int, default=8, help="streams started right after the fault")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    print(f"HF reference for {args.streams} + {args.after} streams ...", file=sys.stderr)
    rows = run(names, args.streams, args.after, args.seed)
    cols = ["scenario", "succeeded", "failed", "migrated", "tokens_lost", "tokens_duplicated",
            "blocks_leaked", "state_left", "detection_s", "recovery_s", "kv_failed",
            "ttft_before_ms", "ttft_after_ms"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    keys = ("failed", "tokens_lost", "tokens_duplicated", "blocks_leaked", "state_left")
    totals = {k: sum(r[k] or 0 for r in rows) for k in keys}
    emit({**totals, "scenarios": rows, "streams": args.streams, "after": args.after})


if __name__ == "__main__":
    main()
