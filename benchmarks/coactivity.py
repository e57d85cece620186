"""How much two workers on one host slow each other: a probe of the running service.

On a GPU cluster a prefill worker and a decode worker have their own devices. On this CPU they
share cores, caches and the memory system with each other and with the router and client, so
a decode step that runs while the other worker prefills takes longer, and so does a prefill
while decode steps run. The simulator models that with two factors of the profile
(``HostCalibration.decode_coactive_x``, ``prefill_coactive_x``); this probe measures them on the
real service, at two requests at a time, never from a load test's own points:

1. prompt B (the workload's longest prompt, one output token) alone, a few times: its TTFT;
2. request A (a mean prompt, a long output) decoding, and B's prompt sent again every second or
   so while it does: A's inter-token gaps that lie inside a B prefill against those outside any,
   and B's TTFT against its TTFT alone.

    .venv/bin/python -m benchmarks.coactivity     # starts a 1P+1D `pdserve serve --model bench`
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from dataclasses import asdict, dataclass

from pdserve.bench.client import PdserveGrpcBackend
from pdserve.bench.workload import RequestSpec


@dataclass(frozen=True)
class Coactivity:
    decode_coactive_x: float  # A's gap inside a B prefill / outside (medians)
    prefill_coactive_x: float  # B's TTFT while A decodes / alone (medians)
    gaps_inside: int
    gaps_outside: int
    decode_gap_ms: float  # median gap outside
    prefill_alone_ms: float


def prompt(i: int, n: int) -> tuple[int, ...]:
    """Distinct per ``i``: no probe request hits the prefix cache of another."""
    return tuple(16 + (i * 7919 + j * 31) % 240 for j in range(n))


def split_gaps(
    token_times: list[float], windows: list[tuple[float, float]], skip: int = 4
) -> tuple[list[float], list[float]]:
    """Gaps between consecutive tokens: those wholly inside a window, and those touching none
    (the first ``skip`` are left out: the request was still settling into its batch)."""
    inside, outside = [], []
    for a, b in itertools.islice(itertools.pairwise(token_times), skip, None):
        if any(w0 <= a and b <= w1 for w0, w1 in windows):
            inside.append(b - a)
        elif not any(a < w1 and w0 < b for w0, w1 in windows):
            outside.append(b - a)
    return inside, outside


async def probe(
    grpc_addr: str, input_len: int, long_len: int, rounds: int = 5, output_len: int = 600
) -> Coactivity:
    backend = PdserveGrpcBackend(grpc_addr, None, temperature=0.0)
    try:
        alone, failed = [], []
        for i in range(4):
            r = await backend.send(RequestSpec(0.0, prompt(1000 + i, long_len), long_len, 1))
            failed += [r.error] if not r.success else []
            if i:  # the first warms up
                alone.append(r.ttft)
        t0 = time.perf_counter()
        task = asyncio.create_task(
            backend.send(RequestSpec(0.0, prompt(2000, input_len), input_len, output_len))
        )
        await asyncio.sleep(1.0)
        windows, loaded = [], []
        for i in range(rounds):
            tb = time.perf_counter()
            r = await backend.send(RequestSpec(0.0, prompt(3000 + i, long_len), long_len, 1))
            failed += [r.error] if not r.success else []
            windows.append((tb, tb + r.ttft))
            loaded.append(r.ttft)
            await asyncio.sleep(0.6)
        a = await task
    finally:
        await backend.close()
    if not a.success or failed:
        raise RuntimeError(f"probe requests failed: {[a.error, *failed]}")
    times = list(itertools.accumulate([t0 + a.ttft, *a.itls]))
    if windows[-1][1] > times[-1]:
        raise RuntimeError("request A finished before the last prefill: raise output_len")
    inside, outside = split_gaps(times, windows)
    if len(inside) < 5 or len(outside) < 20:
        raise RuntimeError(f"too few gaps to compare: {len(inside)} inside, {len(outside)} outside")
    return Coactivity(
        decode_coactive_x=max(1.0, statistics.median(inside) / statistics.median(outside)),
        prefill_coactive_x=max(1.0, statistics.median(loaded) / statistics.median(alone)),
        gaps_inside=len(inside),
        gaps_outside=len(outside),
        decode_gap_ms=statistics.median(outside) * 1000,
        prefill_alone_ms=statistics.median(alone) * 1000,
    )


def main() -> None:
    from benchmarks.client import start_pdserve
    from benchmarks.common import emit

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--long-len", type=int, default=384)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    flags = "--model bench --max-num-batched-tokens 512 --max-num-seqs 64 --kv-cache-mib 512"
    server = start_pdserve(*flags.split(), "--prefill", "1", "--decode", "1", "--cpus-per-worker", "1")
    try:
        c = asyncio.run(probe(server.grpc, args.input_len, args.long_len, args.rounds))
    finally:
        server.stop()
    print(c)
    emit(asdict(c))


if __name__ == "__main__":
    main()
