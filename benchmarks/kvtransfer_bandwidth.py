"""KV transfer throughput against this machine's ceilings, and layer-wise streaming overhead.

For the KV of a 2,048-token request of the ``bench`` preset (12 layers x 128 blocks x 32 KiB =
48 MiB) and larger ones, moved between random block permutations:

* ``shm``: bytes/s as a ratio of a plain memcpy of the same bytes measured in this run (each
  transfer configuration runs in a fresh process, as a worker allocates its cache once);
* ``tcp`` (loopback): bytes/s as a ratio of a raw socket ``sendall``/``recv_into`` stream of the
  same bytes measured in this run;
* ``layerwise_prefill_overhead``: (prefill of 2,048 tokens on the ``bench`` engine + the time
  until the receiver holds every layer, streaming layer by layer over shm) / prefill alone.

Run: ``.venv/bin/python benchmarks/kvtransfer_bandwidth.py`` (about a minute). Last line: JSON.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit, median_time
from kvtransfer.datapath import allocate_shared_kv_cache
from kvtransfer.states import TransferState
from kvtransfer.transport import KVTransport, TransportConfig
from model_runtime.config import CacheConfig
from model_runtime.engine.llm_engine import EngineConfig, LLMEngine
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler.plan import SchedulerConfig

SECRET = os.urandom(32)
LAYERS, BLOCK, HEADS, DIM = 12, 16, 4, 64  # the bench preset's KV shape


def memcpy_bw(nbytes: int, into_shared: bool = False) -> float:
    """A plain copy of ``nbytes``: into private memory, or into a shared /dev/shm mapping (the
    memory an shm transfer writes, whose page-table and TLB costs a private copy does not pay)."""
    a = torch.ones(nbytes // 4)
    if into_shared:
        b, path = allocate_shared_kv_cache((nbytes // 4,), torch.float32)
        path.unlink()
    else:
        b = torch.empty_like(a)
    return nbytes / median_time(lambda: b.copy_(a), repeat=7, warmup=2)


def socket_bw(nbytes: int) -> float:
    """Raw loopback TCP: one sendall of ``nbytes`` into recv_into of a preallocated buffer."""
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname()[:2])
    conn, _ = srv.accept()
    for s in (cli, conn):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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


def transfer_bw(backend: str, num_blocks: int, scattered: bool = True) -> float:
    """Payload bytes/s of whole transfers between random permutations (``scattered``) or
    between consecutive block ranges, as a fresh pool hands them out."""
    shape = (LAYERS, num_blocks * 2, 2, BLOCK, HEADS, DIM)
    src_cache = torch.randn(shape)
    dst_cache, path = allocate_shared_kv_cache(shape, torch.float32)
    cfg = TransportConfig(backend=backend)
    sender, receiver = KVTransport(src_cache, SECRET, cfg), KVTransport(dst_cache, SECRET, cfg, shm_path=path)
    rng = random.Random(num_blocks)
    n = [0]
    try:
        addr = receiver.listen()

        def once() -> None:
            if scattered:
                src = rng.sample(range(shape[1]), num_blocks)
                dst = rng.sample(range(shape[1]), num_blocks)
            else:
                s0, d0 = rng.randrange(num_blocks), rng.randrange(num_blocks)
                src, dst = list(range(s0, s0 + num_blocks)), list(range(d0, d0 + num_blocks))
            tid = f"{backend}-{n[0]}"
            n[0] += 1
            receiver.expect(tid, dst)
            sender.send(tid, addr, src, dst)
            assert receiver.wait(tid, 60) is TransferState.DONE
            receiver.forget(tid)

        dt = median_time(once, repeat=7, warmup=2)
    finally:
        sender.close()
        receiver.close()
    return LAYERS * num_blocks * 2 * BLOCK * HEADS * DIM * 4 / dt


def _transfer_bw_child(pipe: Any, backend: str, num_blocks: int, scattered: bool) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    pipe.send(transfer_bw(backend, num_blocks, scattered))


def transfer_bw_fresh(backend: str, num_blocks: int, scattered: bool = True) -> float:
    """``transfer_bw`` in a fresh process, as a worker allocates its cache once at start-up:
    repeatedly allocating and freeing 100+ MB caches in one process was measured to slow later
    scattered copies by up to 2.5x, which says nothing about a serving worker."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_transfer_bw_child, args=(child, backend, num_blocks, scattered))
    proc.start()
    try:
        if not parent.poll(300):
            raise TimeoutError(f"{backend} transfer benchmark did not finish")
        return float(parent.recv())
    finally:
        proc.join(timeout=30)


def layerwise_overhead(tokens: int = 2048) -> dict[str, float]:
    engine = LLMEngine(
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
            engine.add_request(
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
            result = engine.runner.execute(plan.chunks, engine._requests, on_layer=hook)
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
        nbytes = LAYERS * blocks * 2 * BLOCK * HEADS * DIM * 4
        mc, sk = memcpy_bw(nbytes), socket_bw(nbytes)
        mc_shared = memcpy_bw(nbytes, into_shared=True)
        shm, tcp = transfer_bw_fresh("shm", blocks), transfer_bw_fresh("tcp", blocks)
        shm_c, tcp_c = (
            transfer_bw_fresh("shm", blocks, scattered=False),
            transfer_bw_fresh("tcp", blocks, scattered=False),
        )
        res[f"memcpy_shared_gbs_{tokens}"] = mc_shared / 1e9
        res[f"shm_shared_ceiling_ratio_{tokens}"] = shm / mc_shared
        res[f"shm_contiguous_ceiling_ratio_{tokens}"] = shm_c / mc
        res[f"tcp_contiguous_ceiling_ratio_{tokens}"] = tcp_c / sk
        res[f"kv_mib_{tokens}"] = nbytes / 2**20
        res[f"memcpy_gbs_{tokens}"] = mc / 1e9
        res[f"socket_gbs_{tokens}"] = sk / 1e9
        res[f"shm_gbs_{tokens}"] = shm / 1e9
        res[f"tcp_gbs_{tokens}"] = tcp / 1e9
        res[f"shm_ceiling_ratio_{tokens}"] = shm / mc
        res[f"tcp_ceiling_ratio_{tokens}"] = tcp / sk
        print(
            f"{tokens} tokens ({nbytes / 2**20:.0f} MiB): memcpy {mc / 1e9:.1f} GB/s "
            f"(into shared memory {mc_shared / 1e9:.1f}), shm {shm / 1e9:.1f} GB/s "
            f"({shm / mc:.2f}; consecutive blocks {shm_c / mc:.2f}); socket {sk / 1e9:.2f} GB/s, "
            f"tcp {tcp / 1e9:.2f} GB/s ({tcp / sk:.2f}; consecutive {tcp_c / sk:.2f})",
            flush=True,
        )
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
