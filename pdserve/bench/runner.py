"""``pdserve bench``: build the workload, send it open-loop, report like ``vllm bench serve``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import math
import random
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench.metrics import RequestResult, Slo, failure_causes, summarize
from pdserve.bench.sweep import add_sweep_args, plot, save, sweep
from pdserve.bench.workload import (
    RequestSpec,
    TraceRow,
    WorkloadError,
    arrival_times,
    length_pairs_random,
    loop_trace,
    num_prompts,
    rate_curve,
    read_sharegpt_lengths,
    read_trace,
    synthetic_requests,
    trace_prompts,
    trace_requests,
)
from pdserve.flags import add_goodput, add_result, add_temperature, int_at_least, save_result

if TYPE_CHECKING:
    from pdserve.bench.client import Backend

DATASETS = ("random", "sharegpt", "trace")
# The client (grpc, httpx) is imported only to send: ``pdserve simulate`` and ``pdserve plan``
# share this module's workload flags and must run where only the pure packages are installed.
BACKENDS = ("openai", "pdserve-grpc")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Lengths, arrivals and replay speed: shared by ``pdserve bench`` and ``pdserve simulate``."""
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument(
        "--duration",
        type=float,
        default=0.0,
        help="send at least this many seconds of arrivals (more requests at higher rates): a fixed "
        "count at a high rate is a burst that ends before decode batches reach steady state",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rate-curve",
        default=None,
        metavar="T:X,...",
        help="the rate over time as multipliers of --request-rate, piecewise linear "
        "(e.g. 0:1,600:4,1200:1: a 4x peak at 10 minutes)",
    )
    p.add_argument(
        "--trace-start",
        type=int,
        default=0,
        help="first trace row to replay (it wraps around): varies a trace run as --seed varies a random one",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="trace replay speed-up (with --request-rate: derived, the trace's pattern at that mean rate)",
    )


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="openai")
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (openai backend)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default: 8000 (openai), 50051 (grpc)")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument(
        "--model",
        default=None,
        help="model id sent to OpenAI-compatible servers (default: the one the server's /v1/models lists; "
        "with several listed, give one)",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", type=Path, default=None, help="sharegpt lengths CSV or trace file")
    add_workload_args(p)
    p.add_argument(
        "--max-concurrency",
        type=int_at_least(1),
        default=None,
        help="requests in flight at most (default: no limit)",
    )
    p.add_argument("--vocab-size", type=int, default=256, help="token ids of random prompts stay below this")
    p.add_argument("--block-size", type=int, default=16, help="tokens per hash id in JSONL traces")
    add_temperature(p)
    add_goodput(p)
    add_result(p)
    p.add_argument("--disable-tqdm", action="store_true")
    add_sweep_args(p)


def build_workload(args: argparse.Namespace) -> list[RequestSpec]:
    """The requests of ``args``, their arrivals along ``--rate-curve`` if one is given."""
    specs = _constant_rate_workload(args)
    curve = rate_curve(args)
    if curve is None:
        return specs
    return [dataclasses.replace(s, arrival_s=curve.warp(s.arrival_s)) for s in specs]


@functools.lru_cache(maxsize=1)
def _trace_replay(
    path: Path, stamp: tuple[int, int], start: int, n: int, vocab: int, block_size: int, seed: int
) -> tuple[tuple[TraceRow, ...], tuple[tuple[int, ...], ...]]:
    """The rows a trace replay uses and their prompts: the same for every rate, so a rate
    search over a fixed ``--num-prompts`` (``pdserve plan``'s points) reads the trace and draws
    its prompts once, not once a point (with ``--duration`` the count, hence the key, moves
    with the rate). ``stamp`` (the file's mtime and size) keys a rewritten file apart; one
    entry is kept (a search replays one workload)."""
    rows = read_trace(path)
    if start + n > len(rows):
        print(
            f"{path}: {len(rows)} rows for rows {start}..{start + n - 1}: replaying the trace lap after lap",
            file=sys.stderr,
        )
    used = loop_trace(rows, n, start)[:n]
    return tuple(used), tuple(trace_prompts(used, vocab, block_size, random.Random(seed)))


def _constant_rate_workload(args: argparse.Namespace) -> list[RequestSpec]:
    rng = random.Random(args.seed)
    n = num_prompts(args)
    if args.dataset_name == "trace":
        if args.dataset_path is None:
            raise WorkloadError("--dataset-name trace needs --dataset-path")
        path = Path(args.dataset_path)  # as given: its suffix chooses the parser
        try:
            st = path.stat()
        except OSError as e:
            raise WorkloadError(f"{args.dataset_path}: {e.strerror or e}") from None
        rows, prompts = _trace_replay(
            path, (st.st_mtime_ns, st.st_size), getattr(args, "trace_start", 0), n, args.vocab_size,
            args.block_size, args.seed,
        )  # fmt: skip
        scale = args.time_scale
        if math.isfinite(args.request_rate):  # replay the trace's pattern at this mean rate
            span = rows[n - 1].timestamp_s - rows[0].timestamp_s if len(rows) >= n > 1 else 0.0
            native = (n - 1) / span if span > 0 else math.inf
            scale = args.request_rate / native if math.isfinite(native) else 1.0
        return trace_requests(rows, n, scale, args.vocab_size, args.block_size, rng, prompts)
    if args.dataset_name == "sharegpt":
        if args.dataset_path is None:
            raise WorkloadError("--dataset-name sharegpt needs --dataset-path (a lengths CSV)")
        pool = read_sharegpt_lengths(args.dataset_path)
        lengths = [pool[rng.randrange(len(pool))] for _ in range(n)]
    else:
        lengths = length_pairs_random(
            n, args.random_input_len, args.random_output_len, args.random_range_ratio, rng
        )
    arrivals = arrival_times(n, args.request_rate, args.burstiness, rng)
    return synthetic_requests(lengths, arrivals, args.vocab_size, rng)


class ModelChoiceError(ValueError):
    """The server offers no model, or several, and ``--model`` did not choose."""


def choose_model(offered: list[str], where: str) -> str:
    """The model to send when ``--model`` is not given: the server's only one."""
    if len(offered) == 1:
        return offered[0]
    if not offered:
        raise ModelChoiceError(f"{where} lists no model: give --model")
    names = ", ".join(offered)
    raise ModelChoiceError(f"{where} lists {len(offered)} models ({names}): choose one with --model")


async def resolve_model(backend: Backend, given: str | None) -> str:
    """``--model``, else what the server says it serves (one request, before any load)."""
    model = given or choose_model(await backend.served_models(), backend.where)
    backend.model = model
    return model


def make_backend(args: argparse.Namespace) -> Backend:
    from pdserve.bench.client import OpenAIBackend, PdserveGrpcBackend

    if args.backend == "openai":
        base = args.base_url or f"http://{args.host}:{args.port or 8000}"
        return OpenAIBackend(base, args.endpoint, args.model, args.api_key, args.temperature)
    return PdserveGrpcBackend(f"{args.host}:{args.port or 50051}", args.api_key, args.temperature)


async def run(
    specs: list[RequestSpec], backend: Backend, max_concurrency: int | None, progress: bool
) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival time (open loop), at most ``max_concurrency`` at once."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), unit="req", file=sys.stderr)
    start = time.perf_counter()

    async def one(spec: RequestSpec) -> RequestResult:
        await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
        if sem is None:
            res = await backend.send(spec)
        else:
            async with sem:
                res = await backend.send(spec)
        if bar is not None:
            bar.update(1)
        return res

    results = await asyncio.gather(*(one(s) for s in specs))
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration


def print_summary(m: dict[str, Any], slo: Slo) -> None:
    line = "=" * 50
    rows = [
        ("Successful requests:", m["completed"]),
        ("Failed requests:", m["failed"]),
        ("Benchmark duration (s):", f"{m['duration']:.2f}"),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
    ]
    if not slo.empty:
        rows.append(("Request goodput (req/s):", f"{m['request_goodput']:.2f}"))
        rows.append(("SLO attainment (all requests):", f"{m['slo_attainment']:.3f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}"),
    ]
    print(f"{' Serving Benchmark Result ':=^50}")
    for k, v in rows:
        print(f"{k:<40}{v:<10}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):  # fmt: skip
        print(f"{title:-^50}")
        for stat in ("mean", "median", "p90", "p99"):
            print(f"{f'{stat.capitalize()} {name.upper()} (ms):':<40}{m[f'{stat}_{name}_ms']:<10.2f}")
    print(line)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    slo = Slo.parse(args.goodput)
    specs = build_workload(args)
    backend = make_backend(args)
    try:
        model = await resolve_model(backend, args.model)
        results, duration = await run(specs, backend, args.max_concurrency, not args.disable_tqdm)
    finally:
        await backend.close()
    m = summarize(results, duration, slo)
    m.update(
        {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": args.backend,
            "model_id": model,
            "num_prompts": len(specs),
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "goodput_slo": {k: v for k, v in vars(slo).items() if v},
            "failure_causes": dict(failure_causes(m["errors"])),
        }
    )
    return m


MAX_CAUSES = 5  # the summary's lines; the result's "errors" has every request's


def print_failures(errors: list[str]) -> None:
    """Failed requests by cause (status and message), counted, the most frequent first."""
    causes = failure_causes(errors)
    if not causes:
        return
    failed = sum(n for _, n in causes)
    print(f"{failed} of {len(errors)} requests failed:", file=sys.stderr)
    for cause, n in causes[:MAX_CAUSES]:
        print(f"  {n:>6}  {cause}", file=sys.stderr)
    rest = causes[MAX_CAUSES:]
    if rest:
        print(f"  {sum(n for _, n in rest):>6}  ({len(rest)} other causes)", file=sys.stderr)


def _served_model(args: argparse.Namespace) -> str:
    """``--model`` or the server's model, asked once (a sweep's points then send it unasked)."""

    async def ask() -> str:
        backend = make_backend(args)
        try:
            return await resolve_model(backend, args.model)
        finally:
            await backend.close()

    return asyncio.run(ask())


def cmd_sweep(args: argparse.Namespace) -> int:
    from pdserve.bench.client import ServerError

    if Slo.parse(args.goodput).empty:
        print("pdserve bench: error: --sweep needs --goodput (the SLO that defines goodput)", file=sys.stderr)
        return 2

    errors: list[str] = []

    async def point(rate: float, seed: int) -> dict[str, Any]:
        ns = argparse.Namespace(
            **{**vars(args), "request_rate": rate, "seed": seed, "disable_tqdm": True, "model": model}
        )
        m = await bench(ns)
        errors.extend(m["errors"])
        return m

    try:
        model = _served_model(args)
        result = asyncio.run(sweep(point, args))
    except ServerError as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 1
    except (WorkloadError, ValueError, OSError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    if errors and all(errors):  # every request of every point failed: there is no curve to report
        print_failures(errors)
        print("pdserve bench: error: no request succeeded at any rate; no result saved", file=sys.stderr)
        return 1
    result["goodput_slo"] = {k: v for k, v in vars(Slo.parse(args.goodput)).items() if v}
    result["num_prompts_per_point"] = args.num_prompts
    result["duration_s_per_point"] = args.duration
    result["seeds_per_point"] = args.sweep_seeds
    bound = "" if result["bracketed"] else " (still meeting the target at the highest rate tried)"
    print(f"goodput: {result['goodput_rate']:.3f} req/s at {result['target']:.0%} joint attainment{bound}")
    path = save(result, args)
    png = args.sweep_plot or path.with_suffix(".png")
    plot(result, png, f"{args.backend} {' '.join(args.goodput)}")
    print(f"saved {path.resolve()} and {png.resolve()}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.sweep:
        return cmd_sweep(args)
    from pdserve.bench.client import ServerError

    try:
        m = asyncio.run(bench(args))
    except ServerError as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 1
    except (WorkloadError, ValueError, OSError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    if m["failed"] and not m["completed"]:  # nothing measured: no table of zeros, no result file
        print_failures(m["errors"])
        print("pdserve bench: error: no request succeeded; no result saved", file=sys.stderr)
        return 1
    print_summary(m, Slo.parse(args.goodput))
    print_failures(m["errors"])
    save_result(args, m, f"{args.backend}-{m['request_rate']}qps-{m['date']}.json")
    return 0
