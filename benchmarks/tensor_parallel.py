"""Tensor parallelism on this machine: KV re-sharding between degrees, and a TP 2 step's cost.

* ``reshard_bytes_exact``: for every pair of prefill and decode degrees in {1, 2, 4} (4 KV
  heads; and 2 KV heads at degree 4, replicated), each decode rank's transport receives, from
  the prefill ranks the re-sharding routes name, exactly its own heads' bytes of each block —
  compared byte for byte with the whole cache's slice — and its byte counter says exactly that.
* ``reshard_overhead_ratio`` (per backend, shm and loopback tcp): the time of a heterogeneous
  route (a head slice out of a wider source cache into a rank's cache) over the time of the
  same bytes moved between ranks of equal degree (whole blocks, caches of that many heads),
  median of repeated transfers of a 2,048-token request of the ``bench`` shape; the headline
  is the worse backend's. Both sides run in this process, one transport per rank.
* ``tp2_step_overhead_ratio``: a TP 2 step's time, less what its collectives cost on loopback
  gloo (the same all-reduces and gather, timed between two processes in this run), over the TP
  1 step's time — with the same two CPUs: TP 1 on two threads, TP 2 on one thread per rank. 1.0:
  tensor parallelism costs only its communication. For a 512-token prefill and a batch-8 decode
  step of the ``bench`` preset.

Run: ``.venv/bin/python -m benchmarks.tensor_parallel`` (about two minutes). Last line: JSON.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.common import emit
from benchmarks.kvtransfer_bandwidth import in_fresh_process
from pdserve.decode_worker.offline import OfflineDriver
from pdserve.kvtransfer.config import TransportConfig
from pdserve.kvtransfer.datapath import allocate_shared_kv_cache
from pdserve.kvtransfer.heads import HeadSlice, for_route
from pdserve.kvtransfer.states import TransferState
from pdserve.kvtransfer.transport import KVTransport
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.kv_cache.tensors import new_kv_cache
from pdserve.model_runtime.parallel.group import TPGroup, serve_store
from pdserve.model_runtime.parallel.reshard import routes
from pdserve.model_runtime.parallel.sharding import kv_heads_of
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig

SECRET = os.urandom(32)
LAYERS, BLOCK, DIM = 12, 16, 64  # the bench preset's KV shape
NUM_BLOCKS = 160
REQUEST_BLOCKS = 128  # a 2,048-token request


def _cache(heads: int, shared: bool) -> tuple[torch.Tensor, Any]:
    shape = (LAYERS, NUM_BLOCKS, 2, BLOCK, heads, DIM)
    if shared:
        return allocate_shared_kv_cache(shape, torch.float32)
    return new_kv_cache(shape, torch.float32), None


class Ranks:
    """One transport per rank of a worker of degree ``tp`` holding ``kv`` heads."""

    def __init__(self, kv: int, tp: int, backend: str, receives: bool, fill: torch.Tensor | None) -> None:
        self.tp, self.caches, self.transports, self.paths = tp, [], [], []
        for r in range(tp):
            first, count = kv_heads_of(kv, tp, r)
            cache, path = _cache(count, receives and backend == "shm")
            if fill is not None:
                cache.copy_(fill[..., first : first + count, :])
            t = KVTransport(cache, SECRET, TransportConfig(backend=backend), path)
            if receives:
                t.listen()
            self.caches.append(cache)
            self.transports.append(t)
            self.paths.append(path)

    def close(self) -> None:
        for t in self.transports:
            t.close()
        for p in self.paths:
            if p is not None:
                p.unlink(missing_ok=True)


def _move(src: KVTransport, dst: KVTransport, blocks: list[int], heads: HeadSlice | None) -> float:
    """One layer-wise transfer of ``blocks`` (same ids both sides), to completion; seconds."""
    tid = uuid.uuid4().hex
    dst.expect(tid, blocks, heads=heads)
    t0 = time.perf_counter()
    src.send(tid, dst.address, blocks, blocks, layerwise=True, peer_offers=dst.offers, heads=heads)
    for layer in range(LAYERS):  # as a prefill worker ships them: layer by layer
        src.layer_ready(tid, layer)
    state = dst.wait(tid, 60.0)
    dt = time.perf_counter() - t0
    if state is not TransferState.DONE:
        raise RuntimeError(f"transfer ended {state}")
    for _ in range(200):  # the sender's record is reported once its done frame is out
        if tid in src.poll().finished_sending:
            break
        time.sleep(0.005)
    for t in (src, dst):
        t.poll()
        t.forget(tid)
    return dt


def reshard_exact(kv: int, p: int, d: int, backend: str) -> bool:
    """Every decode rank holds exactly its heads of the whole cache after one hand-off, and its
    byte counter names exactly those bytes."""
    torch.manual_seed(kv * 100 + p * 10 + d)
    whole = torch.randn(LAYERS, NUM_BLOCKS, 2, BLOCK, kv, DIM)
    src, dst = Ranks(kv, p, backend, False, whole), Ranks(kv, d, backend, True, None)
    blocks = list(range(3, 3 + 40))
    try:
        for r in routes(kv, p, d):
            s_heads, d_heads = kv_heads_of(kv, p, r.src_rank)[1], kv_heads_of(kv, d, r.dst_rank)[1]
            _move(
                src.transports[r.src_rank], dst.transports[r.dst_rank], blocks, for_route(r, s_heads, d_heads)
            )
        for rank, (cache, t) in enumerate(zip(dst.caches, dst.transports, strict=True)):
            first, count = kv_heads_of(kv, d, rank)
            want = whole[:, blocks][..., first : first + count, :]
            if not torch.equal(cache[:, blocks], want):
                return False
            if t.stats.bytes_received != want.numel() * 4:
                return False
        return True
    finally:
        src.close()
        dst.close()


def overhead(backend: str, repeat: int = 7) -> dict[str, float]:
    """Sliced routes (4-head source into 2-head ranks, and 1-head routes) against whole blocks
    between caches of the routed heads' count: the same bytes each time."""
    blocks = list(range(REQUEST_BLOCKS))
    out: dict[str, float] = {}
    for wide, narrow in ((4, 2), (4, 1)):
        src = Ranks(wide, 1, backend, False, torch.randn(LAYERS, NUM_BLOCKS, 2, BLOCK, wide, DIM))
        dst = Ranks(narrow, 1, backend, True, None)
        peer_src = Ranks(narrow, 1, backend, False, torch.randn(LAYERS, NUM_BLOCKS, 2, BLOCK, narrow, DIM))
        try:
            s, t, w = src.transports[0], dst.transports[0], peer_src.transports[0]
            sliced, plain = [], []
            for _ in range(repeat + 1):  # interleaved, so drift in the host's load hits both alike
                sliced.append(_move(s, t, blocks, HeadSlice(0, 0, narrow)))
                plain.append(_move(w, t, blocks, None))
            ratio = statistics.median(sliced[1:]) / statistics.median(plain[1:])
            out[f"{wide}to{narrow}_heads"] = round(ratio, 3)
            nbytes = REQUEST_BLOCKS * LAYERS * 2 * BLOCK * narrow * DIM * 4
            out[f"{wide}to{narrow}_whole_gbps"] = round(nbytes / statistics.median(plain[1:]) / 1e9, 2)
        finally:
            for ranks in (src, dst, peer_src):
                ranks.close()
    return out


# -- TP 2 step ---------------------------------------------------------------------------------
def _engine(tp: int) -> OfflineDriver:
    return OfflineDriver(
        EngineConfig(
            model="bench",
            device="cpu",
            backend="torch",
            tp=tp,
            cache=CacheConfig(block_size=16, num_blocks=512),
            scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16),
        )
    )


def step_times(tp: int, prompt: int, batch: int, repeat: int = 7) -> dict[str, float]:
    """A prefill step of ``prompt`` tokens and a decode step of ``batch`` rows, median seconds
    (run in a fresh process: ``in_fresh_process``)."""
    torch.set_num_threads(2 if tp == 1 else 1)
    engine = _engine(tp)
    try:
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        prefills, decodes = [], []
        for i in range(repeat + 1):
            engine.add_request(f"p{i}", [(7 * i + j) % 30000 + 3 for j in range(prompt)], one)
            t0 = time.perf_counter()
            engine.step()
            prefills.append(time.perf_counter() - t0)
        long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"d{i}", [(11 * i + j) % 30000 + 3 for j in range(64)], long)
        engine.step()  # every prompt of the batch fits one step's budget
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            engine.step()
            decodes.append(time.perf_counter() - t0)
        for i in range(batch):
            engine.abort(f"d{i}")
        return {"prefill": statistics.median(prefills[1:]), "decode": statistics.median(decodes[1:])}
    finally:
        engine.runtime.close()


def _comm_peer(port: int, shapes: Sequence[tuple[str, tuple[int, ...]]], rounds: int) -> None:
    torch.set_num_threads(1)
    g = TPGroup(1, 2, ("127.0.0.1", port), torch.device("cpu"))
    _collectives(g, shapes, rounds)
    g.close()


def _collectives(g: TPGroup, shapes: Sequence[tuple[str, tuple[int, ...]]], rounds: int) -> list[float]:
    bufs = [(kind, torch.randn(shape)) for kind, shape in shapes]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for kind, t in bufs:
            if kind == "reduce":
                g.all_reduce(t)
            else:
                g.all_gather(t)
        times.append(time.perf_counter() - t0)
    return times


def comm_time(rows: int, sampled: int, rounds: int = 9) -> float:
    """A ``bench`` TP 2 step's collectives for ``rows`` tokens (embedding, two all-reduces per
    layer, the logits gather of ``sampled`` rows), between two processes; median seconds."""
    hidden, vocab, layers = 768, 32000, 12
    shapes = [("reduce", (rows, hidden))] * (1 + 2 * layers) + [("gather", (sampled, vocab // 2))]
    store = serve_store()
    child = mp.get_context("spawn").Process(target=_comm_peer, args=(store.port, shapes, rounds))
    child.start()
    g = TPGroup(0, 2, store, torch.device("cpu"))
    times = _collectives(g, shapes, rounds)
    child.join(60)
    g.close()
    return statistics.median(times[1:])


def main() -> None:
    result: dict[str, Any] = {}
    pairs = [(4, p, d) for p, d in itertools.product((1, 2, 4), repeat=2)] + [(2, 4, 1), (2, 1, 4), (2, 4, 2)]
    exact = {f"kv{kv}_{p}to{d}_{b}": reshard_exact(kv, p, d, b) for kv, p, d in pairs for b in ("shm", "tcp")}
    result["reshard_pairs"] = len(exact)
    result["reshard_bytes_exact"] = all(exact.values())
    if not result["reshard_bytes_exact"]:
        result["reshard_failures"] = [k for k, ok in exact.items() if not ok]
    print(f"re-sharding byte-exact over {len(exact)} (pair, backend) cases: {result['reshard_bytes_exact']}")
    for backend in ("shm", "tcp"):
        o = in_fresh_process(overhead, backend)
        result[f"reshard_{backend}"] = o
        print(f"{backend}: sliced / whole of the same bytes: {o}")
    result["reshard_overhead_ratio"] = max(
        v for b in ("shm", "tcp") for k, v in result[f"reshard_{b}"].items() if k.endswith("_heads")
    )
    prompt, batch = 512, 8
    s1, s2 = in_fresh_process(step_times, 1, prompt, batch), in_fresh_process(step_times, 2, prompt, batch)
    t1, t2 = (s1["prefill"], s1["decode"]), (s2["prefill"], s2["decode"])
    comm = (comm_time(prompt, 1), comm_time(batch, batch))
    ratios = [(b - c) / a for a, b, c in zip(t1, t2, comm, strict=True)]
    for name, a, b, c, r in zip(("prefill_512", "decode_b8"), t1, t2, comm, ratios, strict=True):
        print(f"{name}: TP 1 {a * 1e3:.1f} ms, TP 2 {b * 1e3:.1f} ms, collectives {c * 1e3:.1f} ms: {r:.3f}")
        result[f"tp2_{name}"] = {"tp1_ms": round(a * 1e3, 2), "tp2_ms": round(b * 1e3, 2),
                                 "collectives_ms": round(c * 1e3, 2), "ratio": round(r, 3)}  # fmt: skip
    result["tp2_step_overhead_ratio"] = round(max(ratios), 3)
    emit(result)


if __name__ == "__main__":
    main()
