"""Prepared GPU check for kvtransfer: cuda_ipc and nccl transfers, byte-exact, with bandwidth.

* ``cuda_ipc``: receiver and sender in two processes on GPU 0 (CUDA IPC needs one node; one
  GPU is enough); KV of a 2,048-token ``bench`` request in bfloat16 between random block
  permutations; checked by SHA-256 of the destination blocks; throughput against a device copy of
  the same bytes measured in the same run.
* ``nccl``: the same between GPU 0 and GPU 1; NCCL refuses two ranks on one GPU, so with a single
  GPU it says so and skips.

Run: ``python -m benchmarks.gpu_kvtransfer`` (under 5 minutes). The last line is one JSON object.
``--cpu``: the hand-off's fixed cost over this host's shm and tcp paths instead (no GPU; the
shm path is direct-write, as ``cuda_ipc`` is), three rounds, about a minute.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from typing import Any

SHAPE = (12, 512, 2, 16, 4, 64)  # bench preset; 2,048 tokens = 128 blocks
BLOCKS = 128
REPEAT = 10


def _digest(cache: Any, blocks: list[int]) -> str:
    import torch

    data = torch.stack([cache[:, b] for b in blocks], dim=1).contiguous().view(torch.uint8).cpu().numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def _device(device: int | str) -> str:
    """A GPU index, or ``"cpu"`` (the CPU dry run of ``gpu_engine_check``)."""
    return device if isinstance(device, str) else f"cuda:{device}"


def receiver(pipe: Any, backend: str, device: int | str, secret: bytes) -> None:
    import torch

    from pdserve.kvtransfer.config import TransportConfig
    from pdserve.kvtransfer.datapath import allocate_shared_kv_cache
    from pdserve.kvtransfer.states import TransferState
    from pdserve.kvtransfer.transport import KVTransport
    from pdserve.model_runtime.kv_cache.tensors import new_kv_cache

    if isinstance(device, int):
        torch.cuda.set_device(device)
    shm_path = None
    if backend == "shm":  # a peer can write only into a cache in a shared mapping
        cache, shm_path = allocate_shared_kv_cache(SHAPE, torch.bfloat16)
    else:
        cache = new_kv_cache(SHAPE, torch.bfloat16, _device(device))
    t = None
    try:
        t = KVTransport(cache, secret, TransportConfig(backend=backend, io_timeout_s=60), shm_path=shm_path)
        pipe.send(t.listen())
        while True:
            cmd = pipe.recv()
            if cmd[0] == "expect":
                t.expect(cmd[1], cmd[2])
                pipe.send("ok")
            elif cmd[0] == "wait":
                # Waiting before the sender starts its clock, so the time taken is when this
                # process learns the KV is in (its own reading of the host's monotonic clock,
                # which both processes share), not a pipe's delivery.
                pipe.send("waiting")
                st = t.wait(cmd[1], 60)
                held_at = time.monotonic()
                t.forget(cmd[1])
                pipe.send((st is TransferState.DONE, _digest(cache, cmd[2]) if cmd[3] else "", held_at))
            else:
                return
    finally:
        if t is not None:
            t.close()
        if shm_path is not None:
            shm_path.unlink(missing_ok=True)


def run(
    backend: str, rx_device: int | str, tx_device: int | str, counts: tuple[int, ...] = (BLOCKS,)
) -> dict[str, Any]:
    """Transfers of each of ``counts`` blocks (``REPEAT`` timed of each kind, after two untimed
    whole ones; the first four checked by hash):
    throughput of the largest against a device copy of its bytes, and the median time of each
    size, from ``send`` to the receiving process holding the KV (``by_blocks_ms``: the whole
    hand-off of KV computed before the transfer began, its set-up round trip included) and from
    the last layer marked computed to the same moment when the transfer was begun layer-wise
    beforehand (``exposed_by_blocks_ms``: what a prefill worker's request waits for, as it begins
    the transfer before it computes the prompt's last chunk)."""
    import torch

    from benchmarks.common import median_time
    from pdserve.kvtransfer.config import TransportConfig
    from pdserve.kvtransfer.states import TransferState
    from pdserve.kvtransfer.transport import KVTransport
    from pdserve.model_runtime.kv_cache.tensors import new_kv_cache

    secret = os.urandom(32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, backend, rx_device, secret))
    proc.start()
    child.close()  # the child's end lives in the child: a child that dies ends our recv
    device = _device(tx_device)
    if isinstance(tx_device, int):
        torch.cuda.set_device(tx_device)
    cache = new_kv_cache(SHAPE, torch.bfloat16, device)
    cache.copy_(torch.randn(SHAPE, device=device))
    tx = KVTransport(cache, secret, TransportConfig(backend=backend, io_timeout_s=60))
    try:
        addr = parent.recv()
        rng = random.Random(0)
        exact = True
        by_blocks: dict[int, float] = {}
        exposed: dict[int, float] = {}
        for n in counts:
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(2 * REPEAT + 2):
                layerwise = i >= 2 and i % 2 == 1
                src, dst = rng.sample(range(SHAPE[1]), n), rng.sample(range(SHAPE[1]), n)
                tid = f"{backend}-{n}-{i}"
                parent.send(("expect", tid, dst))
                assert parent.recv() == "ok"
                if layerwise:  # begun while the prompt's last chunk computes: answered by then
                    tx.send(tid, addr, src, dst, layerwise=True)
                    accepted_by = time.monotonic() + 10
                    while tx.state(tid) is TransferState.BOOTSTRAPPING:
                        assert time.monotonic() < accepted_by, f"{tid}: begin not answered"
                        time.sleep(0.0005)
                parent.send(("wait", tid, dst, i < 4))  # 3 whole and 1 layer-wise checked by hash
                assert parent.recv() == "waiting"
                t0 = time.monotonic()
                if layerwise:
                    tx.layer_ready(tid, SHAPE[0] - 1)
                else:
                    tx.send(tid, addr, src, dst)
                ok, digest, held_at = parent.recv()
                exact &= ok and (not digest or digest == _digest(cache, src))
                if i >= 2:
                    times[layerwise].append(held_at - t0)
            by_blocks[n] = statistics.median(times[False]) * 1e3
            exposed[n] = statistics.median(times[True]) * 1e3
        n = max(counts)
        nbytes = n * SHAPE[0] * cache[0, 0].numel() * cache.element_size()
        a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
        b = torch.empty_like(a)
        copy_bw = nbytes / median_time(lambda: b.copy_(a), repeat=9, warmup=2, device=a.device)
        bw = nbytes / (by_blocks[n] / 1e3)
        return {
            "byte_exact": bool(exact),
            "gbs": bw / 1e9,
            "device_copy_gbs": copy_bw / 1e9,
            "ratio": bw / copy_bw,
            "by_blocks_ms": by_blocks,
            "exposed_by_blocks_ms": exposed,
            "block_bytes": SHAPE[0] * cache[0, 0].numel() * cache.element_size(),
        }
    finally:
        tx.close()
        parent.send(("stop",))
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def fixed_cost_ms(by_blocks_ms: dict[int, float], block_bytes: int) -> tuple[float, float]:
    """Least-squares line through (bytes, ms): the intercept (a hand-off's fixed cost, ms) and
    the slope (ms per MiB)."""
    xs = [n * block_bytes / (1 << 20) for n in by_blocks_ms]
    ys = list(by_blocks_ms.values())
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def cpu_handoff(rounds: int = 3) -> dict[str, Any]:
    """The hand-off's fixed cost on this host's CPU paths (shm: direct-write, as ``cuda_ipc``;
    tcp), ``rounds`` times each: the medians of the whole and exposed intercepts."""
    out: dict[str, Any] = {}
    for backend in ("shm", "tcp"):
        whole, exposed = [], []
        for _ in range(rounds):
            r = run(backend, "cpu", "cpu", (1, 4, 16, 64))
            assert r["byte_exact"], f"{backend}: bytes differ"
            whole.append(fixed_cost_ms(r["by_blocks_ms"], r["block_bytes"])[0])
            exposed.append(fixed_cost_ms(r["exposed_by_blocks_ms"], r["block_bytes"])[0])
            print(backend, {k: round(v, 3) for k, v in r["by_blocks_ms"].items()},
                  {k: round(v, 3) for k, v in r["exposed_by_blocks_ms"].items()}, flush=True)  # fmt: skip
        out[backend] = {
            "fixed_ms": statistics.median(whole),
            "exposed_fixed_ms": statistics.median(exposed),
            "rounds_fixed_ms": whole,
            "rounds_exposed_fixed_ms": exposed,
        }
    return out


def main() -> int:
    import torch

    if "--cpu" in sys.argv[1:]:
        print(json.dumps(cpu_handoff(), sort_keys=True))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    result: dict[str, Any] = {"gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name(0)}
    for backend, rx, tx in (("cuda_ipc", 0, 0), ("nccl", 1, 0)):
        if backend == "nccl" and torch.cuda.device_count() < 2:
            result["nccl"] = {"skipped": "NCCL needs two GPUs (it refuses two ranks on one GPU)"}
            continue
        try:
            result[backend] = run(backend, rx, tx)
        except Exception as e:  # report, then let the exit code say it failed
            result[backend] = {"error": f"{type(e).__name__}: {e}"}
        print(backend, result[backend], flush=True)
    print(json.dumps(result, sort_keys=True))
    failed = [
        k
        for k in ("cuda_ipc", "nccl")
        if "error" in result.get(k, {}) or result.get(k, {}).get("byte_exact") is False
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
