"""Chaos: a real 2 prefill + 2 decode deployment on a local Ray cluster, 16 concurrent greedy
streams of mixed lengths checked token by token against HF transformers, one fault per
scenario; what a client would see.

Scenarios (each on a fresh deployment): no fault; SIGKILL of a decode worker mid-stream;
SIGKILL of a prefill worker with prompts queued (mid-prefill); SIGSTOP of a decode worker for
5 s (then SIGCONT); SIGTERM of a decode worker mid-stream. Per scenario: requests succeeded /
failed, streams migrated, tokens lost (a stream shorter than its reference, or different from
it) and duplicated (longer), KV blocks still in use after the traffic on the surviving
workers, detection time (fault -> the router marks the worker lost), recovery time (fault ->
the last moved stream's first token after the worker was seen lost), TTFT p50 and p99 of the
scenario's streams.

    .venv/bin/python benchmarks/chaos.py            # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/chaos.py --scenarios none,decode_kill

The final JSON line totals ``failed``, ``tokens_lost``, ``tokens_duplicated`` and
``blocks_leaked`` over all scenarios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit

SCENARIOS = ("none", "decode_kill", "prefill_kill", "decode_stop", "decode_term")
SIGNALS = {"decode_kill": signal.SIGKILL, "prefill_kill": signal.SIGKILL, "decode_stop": signal.SIGSTOP,
           "decode_term": signal.SIGTERM}  # fmt: skip


@dataclass
class StreamLog:
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    start: float = 0.0
    migrations: int = 0
    error: str = ""


def reference(model: Any, prompt: list[int], n: int) -> list[int]:
    """HF greedy continuation (EOS ignored), with the model's own KV cache."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        toks = [int(out.logits[0, -1].argmax())]
        past = out.past_key_values
        for _ in range(n - 1):
            out = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            toks.append(int(out.logits[0, -1].argmax()))
    return toks


def workload(seed: int, n: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, 256) for _ in range(rng.choice([5, 40, 120, 300, 600]))],
            rng.choice([48, 96, 160]),
        )
        for _ in range(n)
    ]


def wait_for(cond: Any, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"not within {timeout_s}s: {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


def start(prefill: int, decode: int) -> tuple[Any, Any]:
    """A deployment on the running Ray instance, with its gRPC stub."""
    import grpc

    from pdserve.deploy.pools import PoolSpec
    from pdserve.deploy.service import Service, ServiceThread
    from pdserve.model_runtime.config import CacheConfig
    from pdserve.model_runtime.engine.runtime import EngineConfig
    from pdserve.model_runtime.scheduler.plan import SchedulerConfig
    from pdserve.router.config import Caps, RouterConfig
    from pdserve.v1 import inference_pb2_grpc as pb_grpc

    engine = EngineConfig(model="tiny", cache=CacheConfig(block_size=16, num_blocks=512),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32))  # fmt: skip
    spec = PoolSpec(prefill=prefill, decode=decode, engine=engine)
    config = RouterConfig(
        http_port=0, grpc_port=0, caps=Caps(max_tokens=2048), model_name="tiny", local_prefill=False
    )
    st = ServiceThread(Service(spec, config, use_ray=True))
    ep = st.start()
    return st, pb_grpc.InferenceStub(grpc.insecure_channel(ep.grpc))


def run_stream(stub: Any, log: StreamLog) -> None:
    from pdserve.v1 import inference_pb2 as pb

    req = pb.GenerateRequest(stream=True)
    req.token_ids.ids.extend(log.prompt)
    req.sampling.max_tokens = log.max_tokens
    req.sampling.temperature = 0.0
    req.sampling.ignore_eos = True
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
        log.error = f"{type(e).__name__}: {details}"


def scenario(name: str, work: list[tuple[list[int], int]], refs: list[list[int]]) -> dict[str, Any]:
    st, s = start(prefill=2, decode=2)
    try:
        handles = {h.worker_id: h for h in st.service.handles}
        logs = [StreamLog(p, m) for p, m in work]
        threads = [threading.Thread(target=run_stream, args=(s, lg)) for lg in logs]
        victim = None if name == "none" else name.split("_")[0] + "-0"
        for t in threads:
            t.start()
        if name == "prefill_kill":
            time.sleep(0.05)  # prompts queued, prefill under way
        elif victim is not None:  # mid-stream: every stream has tokens
            wait_for(lambda: all(lg.tokens or lg.error for lg in logs), 60, "every stream started")
        t_fault = time.monotonic()
        detected = 0.0
        if victim is not None:
            pid = handles[victim].info.pid
            os.kill(pid, SIGNALS[name])
            detected = wait_for(lambda: not handles[victim].alive, 30, f"{victim} seen lost")
            if name == "decode_stop":
                threading.Timer(max(0.0, 5.0 - detected), lambda: _cont(pid)).start()
        for t in threads:
            t.join(180)
        lost = dup = failed = 0
        for lg, ref in zip(logs, refs, strict=True):
            if lg.error:
                failed += 1
            n_ok = next(
                (i for i, (a, b) in enumerate(zip(lg.tokens, ref, strict=False)) if a != b),
                min(len(lg.tokens), len(ref)),
            )
            lost += len(ref) - n_ok
            dup += max(0, len(lg.tokens) - len(ref))
        moved = [lg for lg in logs if lg.migrations]
        seen = t_fault + detected  # tokens before this may still be the lost worker's
        recovery = max((next((t for t in lg.times if t > seen), seen) - t_fault for lg in moved), default=0.0)
        time.sleep(1.0)  # aborts and frees settle
        leaked = state_left = 0
        for h in st.service.handles:
            if h.alive:
                state = st.run(h.call("request_state", timeout_s=10))
                load = st.run(h.call("load", timeout_s=10))
                leaked += load.kv_total - load.kv_free  # blocks in use (cached ones count as free)
                state_left += sum(state.values())
        ttfts = sorted((lg.times[0] - lg.start) * 1e3 for lg in logs if lg.times)
        return {
            "scenario": name, "succeeded": len(logs) - failed, "failed": failed, "migrated": len(moved),
            "tokens_lost": lost, "tokens_duplicated": dup, "blocks_leaked": leaked, "state_left": state_left,
            "detection_s": round(detected, 3), "recovery_s": round(recovery, 3),
            "ttft_ms_p50": round(statistics.median(ttfts), 1) if ttfts else None,
            "ttft_ms_p99": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1) if ttfts else None,
            "errors": sorted({lg.error for lg in logs if lg.error})[:3],
        }  # fmt: skip
    finally:
        st.stop()


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the router already stopped it for good
        os.kill(pid, signal.SIGCONT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")

    import transformers

    from pdserve.deploy.ray_pools import start_ray
    from pdserve.model_runtime.presets import resolve_model

    work = workload(args.seed, args.streams)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(resolve_model("tiny"))).eval()
    print(f"HF reference for {len(work)} streams ...", file=sys.stderr)
    refs = [reference(model, p, m) for p, m in work]
    start_ray(None, 16)
    rows = []
    for name in names:
        print(f"scenario {name} ...", file=sys.stderr)
        row = scenario(name, work, refs)
        print(row, file=sys.stderr)
        rows.append(row)
    cols = ["scenario", "succeeded", "failed", "migrated", "tokens_lost", "tokens_duplicated",
            "blocks_leaked", "state_left", "detection_s", "recovery_s",
            "ttft_ms_p50", "ttft_ms_p99"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    keys = ("failed", "tokens_lost", "tokens_duplicated", "blocks_leaked", "state_left")
    totals = {k: sum(r[k] for r in rows) for k in keys}
    emit({**totals, "scenarios": rows, "streams": args.streams})


if __name__ == "__main__":
    main()
