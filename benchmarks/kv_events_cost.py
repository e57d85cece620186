"""What logging the prefix cache's events costs a worker's step path (pure Python, CPU).

A worker's block pool tells its event log every key it publishes and evicts
(``pdserve.worker.kv_events``); the channel thread takes them once a batch. This measures, on
the KV manager the engines use, a prompt's whole block cycle — look up its prefix, allocate
its blocks (evicting cached ones), publish them, free them — with and without the log, and
the channel's side: one take and the frame's encoding and decoding for a step's worth of ops.

    .venv/bin/python -m benchmarks.kv_events_cost

Final JSON line: microseconds a prompt with and without the log (medians of alternating rounds),
microseconds one logged event costs on its own, and the channel's microseconds a take (with
``--ops`` ops: about a step's) taken, encoded and decoded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.worker.codec import decode_batch, encode_batch
from pdserve.worker.kv_events import KvEventLog
from pdserve.worker.messages import OutputBatch, WorkerLoad, WorkerRole


class Cycle:
    """A prompt's whole block cycle on one KV manager, prompt after prompt (each new)."""

    def __init__(self, logged: bool, tokens: int, block_size: int) -> None:
        blocks = 4 * tokens // block_size  # room for four prompts: every later one evicts
        self.kv = KVCacheManager(blocks, block_size)
        self.log = KvEventLog(blocks) if logged else None
        if self.log is not None:
            self.kv.pool.listen(self.log)
        self.tokens = tokens
        self.n = 0
        self.events = 0

    def run(self, prompts: int) -> float:
        """Seconds a prompt over ``prompts`` new ones."""
        kv, tokens, params = self.kv, self.tokens, SamplingParams(max_tokens=1)
        reqs = []
        for _ in range(prompts):
            self.n += 1
            reqs.append(Request(f"r{self.n}", tuple(range(self.n * tokens, (self.n + 1) * tokens)), params))
        t0 = time.perf_counter()
        for req in reqs:
            computed, hit = kv.get_computed_blocks(req)
            kv.allocate_slots(req, tokens - hit, computed)
            req.num_computed_tokens = tokens
            kv.cache_computed_blocks(req)
            kv.free(req.request_id)
            if self.log is not None and (taken := self.log.take()) is not None:  # the channel's take
                self.events += len(taken.ops)
        return (time.perf_counter() - t0) / prompts


def event_s(n: int) -> float:
    """Seconds of one logged event alone (a store or an eviction)."""
    log = KvEventLog(n)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    t0 = time.perf_counter()
    for k in keys:
        log.stored(k)
    for k in keys:
        log.removed(k)
    s = (time.perf_counter() - t0) / (2 * n)
    log.take()
    return s


def channel_take(ops: int, repeat: int) -> float:
    """Seconds of one take of ``ops`` events plus their frame's encoding and decoding."""
    log = KvEventLog(ops)
    load = WorkerLoad("w", WorkerRole.DECODE, "", 0, 0, 1, 1, 0)
    times = []
    for r in range(repeat):
        for i in range(ops):
            log.stored((r * ops + i).to_bytes(16, "little"))
        t0 = time.perf_counter()
        decode_batch(encode_batch("w", OutputBatch((), load, log.take()))[4:], "w")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="a prompt's tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--ops", type=int, default=64, help="block events a step (a take)")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of 50 prompts, alternating")
    args = ap.parse_args()
    plain, logged = Cycle(False, args.tokens, args.block_size), Cycle(True, args.tokens, args.block_size)
    base, with_log = [], []
    for _ in range(args.rounds):  # alternating rounds: drift on a shared host hits both alike
        base.append(plain.run(50))
        with_log.append(logged.run(50))
    b, w = statistics.median(base), statistics.median(with_log)
    events = logged.events // logged.n
    out = {
        "prompt_tokens": args.tokens,
        "block_events_a_prompt": events,
        "us_a_prompt_without_log": round(b * 1e6, 1),
        "us_a_prompt_with_log": round(w * 1e6, 1),
        "us_an_event": round(statistics.median(event_s(4096) for _ in range(20)) * 1e6, 3),
        "channel_us_a_take": round(channel_take(args.ops, 200) * 1e6, 1),
        "ops_a_take": args.ops,
    }
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
