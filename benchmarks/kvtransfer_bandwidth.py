"""KV transfer throughput against this machine's ceilings, and layer-wise streaming overhead.

For the KV of a 2,048-token request of the ``bench`` preset (12 layers x 128 blocks x 32 KiB =
48 MiB) and larger ones, moved between random block permutations:

* ``shm``: bytes/s of a stream of transfers (3 in flight) as a ratio of a plain memcpy of the
  same number of bytes, measured in the same process right before each round, median against
  median (``*_strict_*``: against the fastest memcpy of the round); each configuration runs in
  a fresh process, as a worker allocates its cache once;
* ``tcp`` (loopback): bytes/s as a ratio of a raw socket ``sendall``/``recv_into`` stream of the
  same bytes measured in this run;
* ``tcp_tls_*`` (``--internal-tls``): tcp over the deployment's TLS, as a ratio of a stream
  over Python's own TLS sockets (one direction per socket) and of plain tcp (``vs_plain_tcp``);
* ``layerwise_prefill_overhead``: (prefill of 2,048 tokens on the ``bench`` engine + the time
  until the receiver holds every layer, streaming layer by layer over shm) / prefill alone.

Run: ``.venv/bin/python -m benchmarks.kvtransfer_bandwidth`` (about 90 seconds). Last line: JSON.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, ParamSpec

import torch

from benchmarks.common import emit, median_time
from pdserve.decode_worker.offline import OfflineDriver
from pdserve.kvtransfer.config import TransportConfig
from pdserve.kvtransfer.datapath import allocate_shared_kv_cache
from pdserve.kvtransfer.states import TransferState
from pdserve.kvtransfer.tls import InternalTls
from pdserve.kvtransfer.transport import KVTransport
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.kv_cache.tensors import new_kv_cache
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig

SECRET = os.urandom(32)
P = ParamSpec("P")
TLS = InternalTls.generate()
ROUNDS = 7  # rounds of (ceiling, then BACK_TO_BACK timed transfers), each a ratio; median
BACK_TO_BACK = 5
# After the ceiling's torch copy, libgomp's team spins for milliseconds (GOMP_SPINCOUNT) and
# would compete with the transfer's copy threads on 2 cores; a pause lets it go idle, as it is
# when a worker's transport copies between forward passes.
SETTLE_S = float(os.environ.get("SETTLE_S", "0.05"))
INFLIGHT = 3  # transfers in flight when measuring throughput
STREAM = 12  # transfers per timed throughput run, INFLIGHT kept in flight
CEILING_COPIES = 5  # memcpys of the transfer's size per round; their median is the ceiling
LAYERS, BLOCK, HEADS, DIM = 12, 16, 4, 64  # the bench preset's KV shape


def kv_bytes(num_blocks: int) -> int:
    """Bytes of ``num_blocks`` blocks' KV over every layer (the bench preset's shape, float32)."""
    return LAYERS * num_blocks * 2 * BLOCK * HEADS * DIM * 4


def memcpy_bw(nbytes: int, into_shared: bool = False) -> float:
    """A plain copy of ``nbytes``: into private memory, or into a shared /dev/shm mapping (the
    memory an shm transfer writes, whose page-table and TLB costs a private copy does not pay)."""
    a = torch.ones(nbytes // 4)
    if into_shared:
        b, path = allocate_shared_kv_cache((1, nbytes // 4), torch.float32)
        b = b.reshape(-1)
        path.unlink()
    else:
        b = torch.empty_like(a)
    return nbytes / median_time(lambda: b.copy_(a), repeat=7, warmup=2)


def socket_bw(nbytes: int, tls: bool = False) -> float:
    """Raw loopback TCP: one sendall of ``nbytes`` into recv_into of a preallocated buffer.
    ``tls``: the same over Python's own TLS sockets (one direction, so one thread per end:
    the use ``SSLSocket`` supports), the deployment's certificates, TLS 1.3."""
    srv = socket.create_server(("127.0.0.1", 0))
    cli: Any = socket.create_connection(srv.getsockname()[:2])
    conn: Any = srv.accept()[0]
    for s in (cli, conn):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls:
        accepted: list[Any] = []
        th = threading.Thread(
            target=lambda: accepted.append(TLS.server_context().wrap_socket(conn, server_side=True))
        )
        th.start()
        cli = TLS.client_context().wrap_socket(cli)
        th.join()
        conn = accepted[0]
    src = bytearray(os.urandom(1 << 20)) * (nbytes >> 20)
    dst = bytearray(len(src))

    def receive() -> None:
        view, got = memoryview(dst), 0
        while got < len(dst):
            got += conn.recv_into(view[got:])

    def once() -> None:
        th = threading.Thread(target=receive)
        th.start()
        cli.sendall(src)
        th.join()

    dt = median_time(once, repeat=5, warmup=1)
    for s in (cli, conn, srv):
        s.close()
    return len(src) / dt


def transfer_bw(
    backend: str,
    num_blocks: int,
    scattered: bool = True,
    inflight: int = 1,
    primed: bool = False,
    tls: bool = False,
) -> dict[str, float]:
    """Payload bytes/s of whole transfers between random permutations (``scattered``) or
    consecutive block ranges (as a fresh pool hands them out): a stream of ``STREAM`` transfers
    with ``inflight`` in flight (1: one transfer alone, its set-up round trip included). ``primed``
    times only the data phase, as the service sees it after prefill: the transfer is begun
    layer-wise and accepted first, then every layer is marked ready and the clock runs until the
    receiver holds them all. Each round is paired with a memcpy of the same bytes right before
    it, so both see the same memory phase."""
    sets = inflight + 1
    shape = (LAYERS, num_blocks * sets, 2, BLOCK, HEADS, DIM)
    src_cache = new_kv_cache(shape, torch.float32)
    src_cache.copy_(torch.randn(shape))
    dst_cache, path = allocate_shared_kv_cache(shape, torch.float32)
    nbytes = kv_bytes(num_blocks)
    # The ceiling copies as many distinct bytes as the transfers touch (``sets`` buffers each
    # way, taken in turn), not one buffer again and again: at 48 MiB a re-copied buffer is
    # partly served from the 32 MiB L3, which the transfers' larger footprint never is.
    ceil_src = torch.ones(sets, nbytes // 4).unbind(0)
    ceil_dst = torch.empty(sets, nbytes // 4).unbind(0)
    turn = itertools.count()

    def ceil_copy(i: int) -> None:
        ceil_dst[i].copy_(ceil_src[i])

    cfg = TransportConfig(backend=backend)
    t = TLS if tls else None
    sender = KVTransport(src_cache, SECRET, cfg, tls=t)
    receiver = KVTransport(dst_cache, SECRET, cfg, shm_path=path, tls=t)
    rng = random.Random(num_blocks)
    n = [0]
    try:
        addr = receiver.listen()

        def blocks(count: int) -> list[tuple[list[int], list[int]]]:
            """(source, destination) blocks of ``count`` transfers; any ``sets - 1`` consecutive
            ones write disjoint destinations (at most ``inflight`` are in flight at once)."""
            if scattered:
                perm = rng.sample(range(shape[1]), shape[1])
                groups = [perm[i * num_blocks : (i + 1) * num_blocks] for i in range(sets)]
                return [(rng.sample(range(shape[1]), num_blocks), groups[k % sets]) for k in range(count)]
            s0 = rng.randrange(num_blocks)
            src = list(range(s0, s0 + num_blocks))
            runs = [list(range(i * num_blocks, (i + 1) * num_blocks)) for i in range(sets)]
            return [(src, runs[k % sets]) for k in range(count)]

        def start(src: list[int], dst: list[int]) -> str:
            tid = f"{backend}-{n[0]}"
            n[0] += 1
            receiver.expect(tid, dst)
            sender.send(tid, addr, src, dst, layerwise=primed)
            return tid

        def finish(tid: str) -> None:
            assert receiver.wait(tid, 60) is TransferState.DONE
            receiver.forget(tid)

        def stream() -> float:
            """``count`` transfers, a new one started as soon as the oldest of the ``inflight``
            in flight is done (a loaded decode worker's steady inbound traffic)."""
            plan = blocks(count)
            t0 = time.perf_counter()
            window: list[str] = []
            for src, dst in plan:
                if len(window) == inflight:
                    finish(window.pop(0))
                window.append(start(src, dst))
            for tid in window:
                finish(tid)
            return time.perf_counter() - t0

        def primed_batch() -> float:
            """The data phase of ``inflight`` transfers begun layer-wise and accepted first."""
            tids = [start(src, dst) for src, dst in blocks(count)]
            while any(sender.state(tid) is TransferState.BOOTSTRAPPING for tid in tids):
                time.sleep(0.0005)
            t0 = time.perf_counter()
            for tid in tids:
                sender.layer_ready(tid, LAYERS - 1)
            for tid in tids:
                finish(tid)
            return time.perf_counter() - t0

        once = primed_batch if primed else stream
        count = inflight if primed else (STREAM if inflight > 1 else 1)
        copies: list[float] = []
        transfers: list[float] = []
        ratios: list[float] = []
        strict: list[float] = []  # against the fastest of the round's memcpys
        for _ in range(ROUNDS):
            # Median against median: the host's memory bandwidth has millisecond bursts (memcpy
            # at 38-45 GB/s beside 22-27 GB/s), and the fastest of a few copies catches one
            # while a transfer stream, longer, averages over them.
            ceil_times = [_timed(partial(ceil_copy, next(turn) % sets)) for _ in range(CEILING_COPIES)]
            copied = statistics.median(ceil_times)
            time.sleep(SETTLE_S)
            once()  # wakes the transport's threads, as steady traffic keeps them awake
            moved = statistics.median(once() for _ in range(BACK_TO_BACK))
            copies.append(copied)
            transfers.append(moved)
            ratios.append(count * copied / moved)
            strict.append(count * min(ceil_times) / moved)
    finally:
        sender.close()
        receiver.close()
    return {
        "bw": count * nbytes / statistics.median(transfers),
        "memcpy": nbytes / statistics.median(copies),
        # each round's transfer against its own ceiling: robust to the host's memory phases
        "ratio": statistics.median(ratios),
        "strict_ratio": statistics.median(strict),
    }


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _child(
    pipe: Any, fn: Callable[..., dict[str, float]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    pipe.send(fn(*args, **kwargs))


def in_fresh_process(
    fn: Callable[P, dict[str, float]], *args: P.args, **kwargs: P.kwargs
) -> dict[str, float]:
    """``fn(*args, **kwargs)`` in a fresh process, as a worker allocates its cache once at
    start-up: repeatedly allocating and freeing 100+ MB caches in one process was measured to
    slow later scattered copies by up to 2.5x, which says nothing about a serving worker."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, fn, args, kwargs))
    proc.start()
    try:
        if not parent.poll(300):
            raise TimeoutError(f"{fn.__name__}{args} did not finish")
        return dict(parent.recv())
    finally:
        proc.join(timeout=30)


def layerwise_overhead(tokens: int = 2048) -> dict[str, float]:
    engine = OfflineDriver(
        EngineConfig(
            model="bench",
            device="cpu",
            cache=CacheConfig(num_blocks=512),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096),
        )
    )
    cache = engine.runner.kv_cache
    dst_cache, path = allocate_shared_kv_cache(tuple(cache.shape), cache.dtype)
    sender = KVTransport(cache, SECRET, TransportConfig(backend="shm"))
    receiver = KVTransport(dst_cache, SECRET, TransportConfig(backend="shm"), shm_path=path)
    addr = receiver.listen()
    rng = random.Random(0)
    alone: list[float] = []
    streamed: list[float] = []
    for rep in range(4):
        for stream in (False, True):
            engine.kv.pool.reset_prefix_cache()
            rid = f"p{rep}{stream}"
            req = engine.add_request(
                rid,
                [rng.randrange(3, 32000) for _ in range(tokens)],
                SamplingParams(max_tokens=1, temperature=0),
            )
            plan = engine.scheduler.schedule()
            src = engine.kv.block_table(rid)
            hook = None
            if stream:
                dst = rng.sample(range(dst_cache.shape[1]), len(src))
                receiver.expect(rid, dst)
                sender.send(rid, addr, src, dst, layerwise=True)

                def hook(i: int, rid: str = rid) -> None:
                    sender.layer_ready(rid, i)

            t0 = time.perf_counter()
            result = engine.runner.execute(plan.chunks, {rid: req}, on_layer=hook)
            if stream:
                assert receiver.wait(rid, 60) is TransferState.DONE
            dt = time.perf_counter() - t0
            engine.scheduler.update(plan, result.sampled)
            engine.abort(rid)
            if rep:  # the first round warms up
                (streamed if stream else alone).append(dt)
    sender.close()
    receiver.close()
    engine.check_integrity()
    p, s = statistics.median(alone), statistics.median(streamed)
    return {"prefill_2048_s": p, "prefill_plus_transfer_2048_s": s, "layerwise_prefill_overhead": s / p}


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    res: dict[str, Any] = {}
    for tokens in (2048, 8192):
        blocks = tokens // BLOCK
        nbytes = kv_bytes(blocks)
        sk = socket_bw(nbytes)
        mc_shared = memcpy_bw(nbytes, into_shared=True)
        res[f"kv_mib_{tokens}"] = nbytes / 2**20
        res[f"socket_gbs_{tokens}"] = sk / 1e9
        res[f"memcpy_shared_gbs_{tokens}"] = mc_shared / 1e9
        line = [f"{tokens} tokens ({nbytes / 2**20:.0f} MiB): socket {sk / 1e9:.2f} GB/s"]
        for backend in ("shm", "tcp"):
            for scattered, layout in ((True, ""), (False, "contiguous_")):
                for inflight, mode in ((INFLIGHT, ""), (1, "single_")):
                    m = in_fresh_process(transfer_bw, backend, blocks, scattered, inflight)
                    ratio = m["ratio"] if backend == "shm" else m["bw"] / sk
                    key = f"{backend}_{layout}{mode}"
                    res[f"{key}gbs_{tokens}"] = m["bw"] / 1e9
                    res[f"{key}ceiling_ratio_{tokens}"] = ratio
                    if backend == "shm":
                        res[f"{key}strict_ceiling_ratio_{tokens}"] = m["strict_ratio"]
                    res[f"{key}memcpy_gbs_{tokens}"] = m["memcpy"] / 1e9
                    line.append(f"{key.rstrip('_')} {m['bw'] / 1e9:.2f} GB/s ({ratio:.2f})")
        m = in_fresh_process(transfer_bw, "shm", blocks, primed=True)  # the data phase alone, after set-up
        res[f"shm_primed_gbs_{tokens}"] = m["bw"] / 1e9
        res[f"shm_primed_ceiling_ratio_{tokens}"] = m["ratio"]
        res[f"shm_primed_strict_ceiling_ratio_{tokens}"] = m["strict_ratio"]
        res[f"shm_primed_ms_{tokens}"] = nbytes / m["bw"] * 1e3
        line.append(f"shm after set-up {m['bw'] / 1e9:.2f} GB/s ({m['ratio']:.2f})")
        res[f"memcpy_gbs_{tokens}"] = res[f"shm_memcpy_gbs_{tokens}"]
        print("; ".join(line), flush=True)
    # --internal-tls: tcp over the deployment's TLS, against Python's own TLS socket stream.
    blocks = 2048 // BLOCK
    nbytes = kv_bytes(blocks)
    tls_sk = socket_bw(nbytes, tls=True)
    res["tls_socket_gbs_2048"] = tls_sk / 1e9
    line = [f"2048 tokens over TLS: TLS socket {tls_sk / 1e9:.2f} GB/s"]
    for inflight, mode in ((INFLIGHT, ""), (1, "single_")):
        m = in_fresh_process(transfer_bw, "tcp", blocks, True, inflight, tls=True)
        res[f"tcp_tls_{mode}gbs_2048"] = m["bw"] / 1e9
        res[f"tcp_tls_{mode}ceiling_ratio_2048"] = m["bw"] / tls_sk
        res[f"tcp_tls_{mode}vs_plain_tcp_2048"] = m["bw"] / 1e9 / res[f"tcp_{mode}gbs_2048"]
        name = mode.rstrip("_") or "stream"
        line.append(f"tcp+tls {name} {m['bw'] / 1e9:.2f} GB/s ({m['bw'] / tls_sk:.2f})")
    print("; ".join(line), flush=True)
    res["shm_ceiling_ratio"] = res["shm_ceiling_ratio_2048"]
    res["tcp_ceiling_ratio"] = res["tcp_ceiling_ratio_2048"]
    res.update(layerwise_overhead())
    print(
        f"prefill 2048: {res['prefill_2048_s']:.3f} s alone, {res['prefill_plus_transfer_2048_s']:.3f} s "
        f"with layer-wise shm streaming ({res['layerwise_prefill_overhead']:.3f}x)",
        flush=True,
    )
    emit(res)


if __name__ == "__main__":
    main()
