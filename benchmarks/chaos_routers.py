"""The chaos suite's router faults (``benchmarks/chaos.py --scenarios router_kill``): a
deployment with two router replicas over one pool (``pdserve serve --routers 2``), greedy
streams spread over both (one connection each, as independent clients connect), and one
replica SIGKILLed mid-stream.

What must hold: every stream on the surviving replica completes exactly (no token lost or
repeated, checked against HF transformers), its pace does not stall; the workers abort the
killed replica's requests within a second (``abort_s``: until no worker holds one), freeing
their blocks; the wave started right after the kill is served by the survivor (the kernel
sends no connection to a dead listener); the killed replica is started again and serves
(``rejoin_s``: from the kill until it serves a request). The killed replica's own streams end
with an error (their client's connection went with it) and are counted apart
(``killed_streams``)."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from benchmarks.chaos import StreamLog, Work, leftovers, stream_request, tally, wait_for, whole

ABORT_LIMIT_S = 1.0


def start_replicated(prefill: int, decode: int, routers: int = 2, model: str = "tiny") -> Any:
    """A deployment with ``routers`` router replicas on the running Ray instance."""
    from pdserve.deploy.pools import PoolSpec
    from pdserve.deploy.service import Service, ServiceThread
    from pdserve.model_runtime.config import CacheConfig, EngineConfig
    from pdserve.model_runtime.scheduler.plan import SchedulerConfig
    from pdserve.router.config import Caps, RouterConfig

    engine = EngineConfig(model=model, cache=CacheConfig(block_size=16, num_blocks=512),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32))  # fmt: skip
    spec = PoolSpec(prefill=prefill, decode=decode, engine=engine)
    config = RouterConfig(http_port=0, grpc_port=0, caps=Caps(max_tokens=2048), model_name=model,
                          local_prefill=False, routers=routers)  # fmt: skip
    st = ServiceThread(Service(spec, config, use_ray=True))
    st.start()
    return st


def stream_alone(address: str, log: StreamLog) -> None:
    """``log``'s stream on a connection of its own (so streams spread over the replicas),
    noting the replica that serves it (``pdserve-router`` metadata) in ``log.router``."""
    import grpc

    from pdserve.v1 import inference_pb2_grpc as pb_grpc

    req = stream_request(log)
    log.start = time.monotonic()
    # A subchannel of its own: gRPC otherwise shares one connection between the channels of a
    # process that name the same target, and every stream would reach the same replica.
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        call = pb_grpc.InferenceStub(channel).Generate(req, timeout=120)
        try:
            log.router = dict(call.initial_metadata()).get("pdserve-router", "?")
            for msg in call:
                now = time.monotonic()
                for t in msg.chunk.token_ids:
                    log.tokens.append(t)
                    log.times.append(now)
        except grpc.RpcError as e:  # a failed request is a result here, not a crash
            log.code = e.code().name
            log.error = f"{log.code}: {e.details()}"


def launch_alone(
    address: str, work: list[tuple[list[int], int]]
) -> tuple[list[StreamLog], list[threading.Thread]]:
    logs = [StreamLog(p, m) for p, m in work]
    threads = [threading.Thread(target=stream_alone, args=(address, lg)) for lg in logs]
    for t in threads:
        t.start()
    return logs, threads


def owned_by(st: Any, router: int) -> int:
    """Requests replica ``router`` owns on the live workers now."""
    from pdserve.worker.control import RequestState

    key = f"owned_by_router_{router + 1}"  # (the pool owner's link is index 0)
    return sum(
        st.run(h.control(RequestState(), timeout_s=10)).get(key, 0) for h in st.service.handles if h.alive
    )


def gaps_ms(logs: list[StreamLog], start: float, end: float) -> list[float]:
    """Inter-token gaps of ``logs`` whose later token came in [start, end)."""
    out = []
    for lg in logs:
        for a, b in zip(lg.times, lg.times[1:], strict=False):
            if start <= b < end and b > a:
                out.append((b - a) * 1e3)
    return out


def router_kill(work: Work, st: Any, grpc_address: str) -> dict[str, Any]:
    """SIGKILL one of two router replicas mid-stream (see the module's docstring)."""

    replicas = st.service.replicas
    wait_for(lambda: whole(st, *_sizes(st)), 120, "every pool whole")
    logs, threads = launch_alone(grpc_address, work.before)
    wait_for(lambda: all(lg.tokens or lg.error for lg in logs), 60, "every stream started")
    refs = list(work.refs_before)
    # Both replicas must hold streams: more of the same prompts until they do (8 streams by a
    # hash of their ports all land on one replica about once in 128 runs).
    i = 0
    while len({lg.router for lg in logs if len(lg.tokens) < lg.max_tokens}) < 2 and i < 16:
        more, more_threads = launch_alone(grpc_address, [work.before[i % len(work.before)]])
        wait_for(lambda m=more[0]: bool(m.tokens or m.error), 60, "an extra stream started")
        logs += more
        threads += more_threads
        refs.append(work.refs_before[i % len(work.before)])
        i += 1
    running = [lg for lg in logs if len(lg.tokens) < lg.max_tokens and not lg.error]
    victim = max({lg.router for lg in running}, key=lambda r: (sum(lg.router == r for lg in running), r))
    index = int(victim)
    old_pid = replicas.pids()[index]
    t_kill = time.monotonic()
    replicas.kill(index)
    abort_s = wait_for(lambda: owned_by(st, index) == 0, 30, "the killed replica's requests aborted")
    after_logs, after_threads = launch_alone(grpc_address, work.after)
    for t in threads + after_threads:
        t.join(180)
    rejoin = wait_for(
        lambda: replicas.pids()[index] not in (None, old_pid) and replicas.replicas[index].ready.is_set(),
        60, "the killed replica started again",
    )  # fmt: skip
    served_by_new = _served_by(grpc_address, victim, work.before[0], work.refs_before[0])
    rejoin_s = time.monotonic() - t_kill if served_by_new else None
    survivors = [(lg, ref) for lg, ref in zip(logs, refs, strict=True) if lg.router != victim]
    killed = [lg for lg in logs if lg.router == victim]
    failed, lost, dup = tally([lg for lg, _ in survivors] + after_logs,
                              [ref for _, ref in survivors] + work.refs_after)  # fmt: skip
    killed_refs = [ref for lg, ref in zip(logs, refs, strict=True) if lg.router == victim]
    k_failed, k_lost, k_dup = tally(killed, killed_refs)
    # what its clients got before the kill was right (a prefix of the reference)
    k_wrong = sum(len(lg.tokens) - len(ref) + k for lg, ref, k in _prefix_lost(killed, killed_refs))
    time.sleep(1.0)  # aborts and frees settle
    leaked, state_left = leftovers(st)
    surv = [lg for lg, _ in survivors]
    before = gaps_ms(surv, t_kill - 2.0, t_kill)
    after = gaps_ms(surv, t_kill, t_kill + 2.0)
    return {
        "scenario": "router_kill", "succeeded": len(surv) + len(after_logs) - failed, "failed": failed,
        "tokens_lost": lost, "tokens_duplicated": dup, "blocks_leaked": leaked, "state_left": state_left,
        "killed_streams": len(killed), "killed_failed": k_failed, "killed_tokens_lost": k_lost,
        "killed_tokens_wrong": k_wrong + k_dup, "after_on": sorted({lg.router for lg in after_logs}),
        "abort_s": round(abort_s, 3), "rejoin_s": None if rejoin_s is None else round(rejoin_s, 2),
        "restart_s": round(rejoin, 2) if rejoin else None,
        "survivor_gap_ms_before": round(statistics.median(before), 2) if before else None,
        "survivor_gap_ms_after": round(statistics.median(after), 2) if after else None,
        "survivor_gap_ms_max_after": round(max(after), 1) if after else None,
        "errors": sorted({lg.error for lg in surv + after_logs if lg.error})[:3],
    }  # fmt: skip


def replica_term(work: Work, st: Any, grpc_address: str) -> dict[str, Any]:
    """SIGTERM one of two router replicas mid-stream: it drains (every stream it holds finishes
    exactly), new connections go to the other meanwhile, and it is started again."""
    import signal

    replicas = st.service.replicas
    wait_for(lambda: all(r.ready.is_set() for r in replicas.replicas), 60, "both replicas serving")
    logs, threads = launch_alone(grpc_address, work.before)
    wait_for(lambda: all(lg.tokens or lg.error for lg in logs), 60, "every stream started")
    running = [lg for lg in logs if len(lg.tokens) < lg.max_tokens and not lg.error]
    victim = max({lg.router for lg in running}, key=lambda r: (sum(lg.router == r for lg in running), r))
    old_pid = replicas.kill(int(victim), signal.SIGTERM)
    # its signal handled: its listeners are closed, its streams go on
    wait_for(lambda: replicas.replicas[int(victim)].draining.is_set(), 10, "the replica draining")
    after_logs, after_threads = launch_alone(grpc_address, work.after)
    for t in threads + after_threads:
        t.join(180)
    failed, lost, dup = tally(logs + after_logs, work.refs_before + work.refs_after)
    restart = wait_for(lambda: replicas.replicas[int(victim)].ready.is_set() and replicas.pids()[int(victim)]
                       not in (None, old_pid), 60, "the drained replica started again")  # fmt: skip
    return {
        "scenario": "replica_term", "failed": failed, "tokens_lost": lost, "tokens_duplicated": dup,
        "drained_streams": sum(lg.router == victim for lg in running), "victim": victim,
        "after_on": sorted({lg.router for lg in after_logs}), "restart_s": round(restart, 2),
        "errors": sorted({lg.error for lg in logs + after_logs if lg.error})[:3],
    }  # fmt: skip


def _prefix_lost(logs: list[StreamLog], refs: list[list[int]]) -> list[tuple[StreamLog, list[int], int]]:
    """Each log with its reference and the reference's tokens past the log's correct prefix."""
    out = []
    for lg, ref in zip(logs, refs, strict=True):
        ok = next((i for i, (a, b) in enumerate(zip(lg.tokens, ref, strict=False)) if a != b),
                  min(len(lg.tokens), len(ref)))  # fmt: skip
        out.append((lg, ref, len(ref) - ok))
    return out


def _sizes(st: Any) -> tuple[int, int]:
    return st.service.spec.prefill, st.service.spec.decode


def _served_by(address: str, router: str, work: tuple[list[int], int], ref: list[int]) -> bool:
    """A request, again and again on new connections, until ``router`` serves one exactly
    (at most 40 tries: the kernel spreads connections evenly over the replicas)."""
    for _ in range(40):
        log = StreamLog(*work)
        stream_alone(address, log)
        if log.router == router:
            return not log.error and log.tokens == ref
    return False
