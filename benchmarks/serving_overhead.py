"""What the serving path itself costs: router + Ray workers + KV handoff, with no model math.

Runs ``pdserve serve --compute zero`` (deterministic tokens, no math: every microsecond is the
serving path's) and, in the same run, the ceiling: bare servers of the same frameworks (FastAPI +
uvicorn SSE, grpc.aio server streaming) that emit the same token stream from a loop, with no
router, workers or transfer behind them. The same client drives both at 1, 16 and 128 concurrent
streams over HTTP and gRPC.

Reported per (protocol, concurrency): aggregate streamed tokens/s and TTFT percentiles at the
client. With zero compute, pdserve's TTFT is entirely serving-path time (router, two worker hops,
KV transfer, first-token relay), so ``router_added_ttft_ms_p50`` is its median at 1 stream minus
the bare server's (what a user would see added in front of an engine). ``router_cpu_us_per_token``
is the router processes' CPU time (user + system) over the tokens they streamed at 128 streams,
per protocol; the headline is the larger of the two (``worker_cpu_us_per_token_*``: the workers').
Then the same deployment with ``--routers 2`` (router replicas) at 128 streams:
``replicas_tokens_per_cpu_ratio`` is tokens per router-CPU-second (the serve process, which owns
the pool, plus its replicas) with 2 replicas over 1, the smaller of the two protocols'; the
``replicas_worker_cpu_us_per_token_*`` next to the single router's show what the workers'
fan-out to every router costs them.

    .venv/bin/python -m benchmarks.serving_overhead            # ~1-2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from benchmarks.client import free_port, start_pdserve, wait_ready
from benchmarks.common import emit
from pdserve.bench.client import PdserveGrpcBackend
from pdserve.bench.workload import RequestSpec
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc

PROMPT = list(range(10, 42))  # 32 tokens


# -- bare servers (the ceiling) ------------------------------------------------------------
def run_bare_http(port: int) -> None:
    import uvicorn

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        n = int(body["max_tokens"])

        async def gen() -> Any:
            for i in range(n):
                choice = {"index": 0, "text": "x", "token_ids": [i % 200], "finish_reason": None}
                chunk = {"choices": [choice]}
                yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
                await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop")


def run_bare_grpc(port: int) -> None:
    class Bare(pb_grpc.InferenceServicer):
        async def Generate(self, request: Any, context: Any) -> Any:
            n = request.sampling.max_tokens
            for i in range(n):
                yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[i % 200], text="x"))
            yield pb.GenerateResponse(result=pb.GenerateResult(finish_reason=pb.FINISH_REASON_LENGTH))

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(Bare(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    import uvloop

    uvloop.run(main())


# -- client ---------------------------------------------------------------------------------
async def http_stream(client: httpx.AsyncClient, base: str, tokens: int) -> tuple[float, int]:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft = 0.0
    n = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ids = json.loads(line[6:])["choices"]
            got = len(ids[0].get("token_ids", [])) if ids else 0
            if got and not n:
                ttft = time.perf_counter() - t0
            n += got
    return ttft, n


async def grpc_stream(backend: PdserveGrpcBackend, tokens: int) -> tuple[float, int]:
    r = await backend.send(RequestSpec(0.0, tuple(PROMPT), len(PROMPT), tokens))
    if not r.success:
        raise RuntimeError(r.error)
    return r.ttft, r.output_len


async def load(
    one: Callable[[], Awaitable[tuple[float, int]]],
    streams: int,
    per_stream: int,
    cpu: Callable[[], float] | None = None,
    worker_cpu: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """``streams`` concurrent streams of ``per_stream`` requests each; ``cpu`` (``worker_cpu``):
    the server's (its workers') CPU seconds so far, read around the run."""
    ttfts: list[float] = []
    total = 0

    async def worker() -> None:
        nonlocal total
        for _ in range(per_stream):
            ttft, n = await one()
            ttfts.append(ttft)
            total += n

    await one()  # warm the connection and the path
    cpu0 = cpu() if cpu is not None else 0.0
    wcpu0 = worker_cpu() if worker_cpu is not None else 0.0
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    wall = time.perf_counter() - t0
    cpu_s = cpu() - cpu0 if cpu is not None else 0.0
    wcpu_s = worker_cpu() - wcpu0 if worker_cpu is not None else 0.0
    ttfts.sort()
    out = {
        "streams": streams,
        "tokens_per_s": total / wall,
        "ttft_ms_p50": 1000 * statistics.median(ttfts),
        "ttft_ms_p90": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
        "requests": len(ttfts),
    }
    if cpu is not None:
        out["server_cpu_us_per_token"] = 1e6 * cpu_s / max(1, total)
    if worker_cpu is not None:
        out["worker_cpu_us_per_token"] = 1e6 * wcpu_s / max(1, total)
    return out


async def measure(
    http_base: str, grpc_addr: str | None, levels: list[int], tokens: int, cpu: Callable[[], float] | None,
    worker_cpu: Callable[[], float] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Every level over HTTP, then (given an address) over gRPC."""
    out: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for c in levels:
            per = max(1, 32 // c)
            out[f"http_{c}"] = await load(
                lambda: http_stream(client, http_base, tokens), c, per, cpu, worker_cpu
            )
            print(f"  http  {c:4d} streams: {out[f'http_{c}']}", file=sys.stderr, flush=True)
    if grpc_addr is None:
        return out
    backend = PdserveGrpcBackend(grpc_addr, None, temperature=1.0)
    try:
        for c in levels:
            per = max(1, 32 // c)
            out[f"grpc_{c}"] = await load(lambda: grpc_stream(backend, tokens), c, per, cpu, worker_cpu)
            print(f"  grpc  {c:4d} streams: {out[f'grpc_{c}']}", file=sys.stderr, flush=True)
    finally:
        await backend.close()
    return out


def processes(server_pid: int, marker: str | None) -> list[Any]:
    """The serve process and its descendants whose command line holds ``marker`` (router
    replicas: ``pdserve.router.replica``; Ray workers: ``PoolWorker``); ``marker`` None: the
    serve process alone."""
    import psutil

    root = psutil.Process(server_pid)
    if marker is None:
        return [root]
    found = []
    for child in root.children(recursive=True):
        try:
            if marker in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # gone meanwhile
            continue
    return found


def cpu_of(procs: list[Any]) -> Callable[[], float]:
    """CPU seconds (user + system) of ``procs`` so far, summed."""

    def cpu() -> float:
        total = 0.0
        for p in procs:
            t = p.cpu_times()
            total += t.user + t.system
        return total

    return cpu


def run_levels(
    args: argparse.Namespace,
    http_base: str,
    grpc_addr: str | None,
    server_pid: int | None = None,
    levels: list[int] | None = None,
) -> dict[str, Any]:
    """Every level; with ``server_pid``, each level's router CPU a token (the serve process
    and its router replicas) and its workers' (``worker_cpu_us_per_token``)."""
    import uvloop

    levels = levels or [int(x) for x in args.streams.split(",")]
    if server_pid is None:
        return uvloop.run(measure(http_base, grpc_addr, levels, args.tokens, None))
    routers = processes(server_pid, None) + processes(server_pid, "pdserve.router.replica")
    workers = processes(server_pid, "PoolWorker")
    out = uvloop.run(measure(http_base, grpc_addr, levels, args.tokens, cpu_of(routers), cpu_of(workers)))
    out["router_processes"] = len(routers)
    out["worker_processes"] = len(workers)
    return out


def measure_peer(args: argparse.Namespace, me: list[str], root: Path) -> dict[str, Any]:
    """vllm-router (Rust) proxying to the bare HTTP server: what a routing layer alone adds."""
    print(f"peer: {args.peer_router} in front of the bare HTTP server:", file=sys.stderr)
    bp, rp = free_port(), free_port()
    bare = subprocess.Popen([*me, "--bare", "http", "--port", str(bp)], cwd=root)
    router = None
    try:
        wait_ready(f"http://127.0.0.1:{bp}/health", bare)
        router = subprocess.Popen(
            [args.peer_router, "--host", "127.0.0.1", "--port", str(rp), "--worker-urls",
             f"http://127.0.0.1:{bp}", "--policy", "round_robin"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_ready(f"http://127.0.0.1:{rp}/health", router)
        return run_levels(args, f"http://127.0.0.1:{rp}", None)
    finally:
        for pr in (router, bare):
            if pr is not None:
                pr.terminate()
                pr.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,16,128")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request")
    p.add_argument(
        "--routers", type=int, default=2,
        help="then router replicas at the top level: replicas_tokens_per_cpu_ratio (1: skip)",
    )  # fmt: skip
    p.add_argument("--transport", default="auto", help="KV transfer backend of the pdserve run")
    p.add_argument(
        "--peer-router",
        default=None,
        help="path of a vllm-router binary: also measure it (router only) in front of the bare server",
    )
    p.add_argument("--bare", choices=["http", "grpc"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bare == "http":
        run_bare_http(args.port)
        return
    if args.bare == "grpc":
        run_bare_grpc(args.port)
        return

    results: dict[str, Any] = {}
    levels = [int(x) for x in args.streams.split(",")]
    root = Path(__file__).resolve().parents[1]
    me = [sys.executable, "-m", "benchmarks.serving_overhead"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        print("bare frameworks (ceiling):", file=sys.stderr)
        hp, gp = free_port(), free_port()
        procs = [
            subprocess.Popen([*me, "--bare", "http", "--port", str(hp)], cwd=root),
            subprocess.Popen([*me, "--bare", "grpc", "--port", str(gp)], cwd=root),
        ]
        wait_ready(f"http://127.0.0.1:{hp}/docs", procs[0])
        time.sleep(1.0)
        results["bare"] = run_levels(args, f"http://127.0.0.1:{hp}", f"127.0.0.1:{gp}")
        for pr in procs:
            pr.terminate()
            pr.wait(10)
        if args.peer_router:
            results["peer"] = measure_peer(args, me, root)
        print("pdserve (zero compute, 1 prefill + 1 decode on Ray):", file=sys.stderr)
        server = start_pdserve(
            "--model", "tiny", "--compute", "zero", "--prefill", "1", "--decode", "1",
            "--transport", args.transport, "--max-num-seqs", "256",
        )  # fmt: skip
        procs = [server.proc]
        results["pdserve"] = run_levels(args, server.http, server.grpc, server.proc.pid)
        server.proc.terminate()
        server.proc.wait(60)
        if args.routers > 1:
            print(f"pdserve with {args.routers} router replicas, at {max(levels)} streams:", file=sys.stderr)
            server = start_pdserve(
                "--model", "tiny", "--compute", "zero", "--prefill", "1", "--decode", "1",
                "--transport", args.transport, "--max-num-seqs", "256", "--routers", str(args.routers),
            )  # fmt: skip
            procs = [server.proc]
            results["replicas"] = run_levels(args, server.http, server.grpc, server.proc.pid, [max(levels)])
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.terminate()
                try:
                    pr.wait(30)
                except subprocess.TimeoutExpired:
                    pr.kill()

    ours, bare = results["pdserve"], results["bare"]
    summary: dict[str, Any] = {
        "stream_tokens_per_s_http": max(ours[f"http_{c}"]["tokens_per_s"] for c in levels),
        "stream_tokens_per_s_grpc": max(ours[f"grpc_{c}"]["tokens_per_s"] for c in levels),
        "router_added_ttft_ms_p50": ours["http_1"]["ttft_ms_p50"] - bare["http_1"]["ttft_ms_p50"],
        "router_added_ttft_ms_p50_grpc": ours["grpc_1"]["ttft_ms_p50"] - bare["grpc_1"]["ttft_ms_p50"],
        "ttft_ms_p50_http_1": ours["http_1"]["ttft_ms_p50"],
        "ttft_ms_p50_grpc_1": ours["grpc_1"]["ttft_ms_p50"],
        "tokens_per_request": args.tokens,
    }
    top = max(levels)
    cpu_per_token = {p: ours[f"{p}_{top}"]["server_cpu_us_per_token"] for p in ("http", "grpc")}
    summary["router_cpu_streams"] = top
    summary["router_cpu_us_per_token_http"] = round(cpu_per_token["http"], 1)
    summary["router_cpu_us_per_token_grpc"] = round(cpu_per_token["grpc"], 1)
    summary["router_cpu_us_per_token"] = round(max(cpu_per_token.values()), 1)
    for proto in ("http", "grpc"):
        summary[f"worker_cpu_us_per_token_{proto}"] = round(
            ours[f"{proto}_{top}"]["worker_cpu_us_per_token"], 1
        )
    if "replicas" in results:
        reps = results["replicas"]
        summary["replicas"] = args.routers
        ratios = {}
        for proto in ("http", "grpc"):
            per = reps[f"{proto}_{top}"]["server_cpu_us_per_token"]
            summary[f"replicas_router_cpu_us_per_token_{proto}"] = round(per, 1)
            summary[f"replicas_worker_cpu_us_per_token_{proto}"] = round(
                reps[f"{proto}_{top}"]["worker_cpu_us_per_token"], 1
            )
            summary[f"replicas_{proto}_{top}_tokens_per_s"] = round(reps[f"{proto}_{top}"]["tokens_per_s"])
            ratios[proto] = cpu_per_token[proto] / per  # tokens per router-CPU-second, N replicas over one
            summary[f"replicas_tokens_per_cpu_ratio_{proto}"] = round(ratios[proto], 3)
        summary["replicas_tokens_per_cpu_ratio"] = round(min(ratios.values()), 3)
    for proto in ("http", "grpc"):
        for c in levels:
            k = f"{proto}_{c}"
            summary[f"{k}_tokens_per_s"] = round(ours[k]["tokens_per_s"])
            summary[f"{k}_ceiling_ratio"] = round(ours[k]["tokens_per_s"] / bare[k]["tokens_per_s"], 3)
            summary[f"{k}_ttft_ms_p50"] = round(ours[k]["ttft_ms_p50"], 2)
            summary[f"{k}_bare_ttft_ms_p50"] = round(bare[k]["ttft_ms_p50"], 2)
    if "peer" in results:
        peer = results["peer"]
        summary["peer_router_added_ttft_ms_p50"] = round(
            peer["http_1"]["ttft_ms_p50"] - bare["http_1"]["ttft_ms_p50"], 2
        )
        for c in levels:
            summary[f"peer_http_{c}_tokens_per_s"] = round(peer[f"http_{c}"]["tokens_per_s"])
            summary[f"peer_http_{c}_ttft_ms_p50"] = round(peer[f"http_{c}"]["ttft_ms_p50"], 2)
    emit(summary)


if __name__ == "__main__":
    main()
