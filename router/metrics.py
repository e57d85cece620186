"""Prometheus metrics of the router, named as vLLM names them under the ``pdserve:`` prefix.

Request metrics are observed once per request when it ends (TTFT, TPOT, ITL, E2E, queue time,
token counts, success by finish reason, failures by status code); worker gauges (running,
waiting, KV usage, health) and KV transfer counters are read at scrape time from the load each
worker last reported. The registry belongs to one router, so several routers (tests) never
share series. Histogram buckets follow vLLM's plus every configured SLO threshold, so
attainment can be charted exactly.

PD- and SLO-specific series: ``slo_requests`` / ``slo_ttft_met`` / ``slo_tpot_met`` /
``slo_met`` per SLO class (goodput = rate of ``slo_met``), ``goodput_requests_per_second`` and
``slo_attainment`` over the router's last minute, ``router_decisions`` by policy, outcome and
reason, ``prediction_error_ratio`` (observed / predicted), ``latency_correction`` per worker and
phase, ``kv_handoff_seconds``, and ``kv_transfer_*`` per worker.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.router.slo import SloBook, SloResult, SloTracker
from pdserve.router.stream import Final
from pdserve.worker.messages import WorkerHealth, WorkerLoad

P = "pdserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)
HANDOFF_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
WINDOW_S = 60.0


def _with(buckets: Sequence[float], extra: Iterable[float]) -> list[float]:
    return sorted({*buckets, *extra})


class _Workers(Collector):
    def __init__(self, loads: Callable[[], Iterable[WorkerLoad]]) -> None:
        self.loads = loads

    def collect(self) -> Iterable[Metric]:
        running = GaugeMetricFamily(
            P + "num_requests_running", "Requests running on a worker", labels=["worker", "role"]
        )
        waiting = GaugeMetricFamily(
            P + "num_requests_waiting", "Requests waiting on a worker", labels=["worker", "role"]
        )
        kv = GaugeMetricFamily(
            P + "kv_cache_usage_perc", "Fraction of KV blocks in use", labels=["worker", "role"]
        )
        healthy = GaugeMetricFamily(
            P + "worker_healthy", "1 when the worker is healthy", labels=["worker", "role"]
        )
        busy = CounterMetricFamily(
            P + "worker_busy_seconds", "Wall time of the worker's computing steps", labels=["worker", "role"]
        )
        degree = GaugeMetricFamily(
            P + "worker_tp_degree", "GPUs (tensor-parallel ranks) the worker spans", labels=["worker", "role"]
        )
        for w in self.loads():
            labels = [w.worker_id, w.role.value]
            degree.add_metric(labels, w.tp)
            running.add_metric(labels, w.running)
            waiting.add_metric(labels, w.waiting)
            kv.add_metric(labels, w.kv_usage)
            healthy.add_metric(labels, 1.0 if w.health is WorkerHealth.HEALTHY else 0.0)
            busy.add_metric(labels, w.busy_s)
        return [running, waiting, kv, healthy, busy, degree, *self._transfers()]

    def _transfers(self) -> list[Metric]:
        labels = ["worker", "role"]
        nbytes = CounterMetricFamily(
            P + "kv_transfer_bytes",
            "KV bytes sent (prefill) or received (decode), by the backend that moved them",
            labels=[*labels, "backend"],
        )
        secs = CounterMetricFamily(P + "kv_transfer_seconds", "Time spent in KV transfers", labels=labels)
        count = CounterMetricFamily(P + "kv_transfers", "KV transfers completed", labels=labels)
        failed = CounterMetricFamily(
            P + "kv_transfer_failures", "KV transfers failed, by cause", labels=[*labels, "cause"]
        )
        for w in self.loads():
            t = w.transfers
            if t is None:
                continue
            lv = [w.worker_id, w.role.value]
            for backend, n in t.by_backend:
                nbytes.add_metric([*lv, backend], n)
            secs.add_metric(lv, t.seconds)
            count.add_metric(lv, t.count)
            for cause, n in t.failures:
                failed.add_metric([*lv, cause], n)
        return [nbytes, secs, count, failed]


class _Slo(Collector):
    """Goodput and attainment over the router's last minute, per SLO class, and the dispatcher's
    latency corrections, computed at scrape time."""

    def __init__(
        self, book: SloBook, tracker: SloTracker, corrections: Callable[[], Iterable[tuple[str, str, float]]]
    ) -> None:
        self.book, self.tracker, self.corrections = book, tracker, corrections

    def collect(self) -> Iterable[Metric]:
        goodput = GaugeMetricFamily(P + "goodput_requests_per_second",
                                    f"Requests meeting both SLOs per second over the last {WINDOW_S:g}s",
                                    labels=["slo_class"])  # fmt: skip
        attain = GaugeMetricFamily(P + "slo_attainment",
                                   f"Fraction of requests meeting both SLOs over the last {WINDOW_S:g}s",
                                   labels=["slo_class"])  # fmt: skip
        now = time.monotonic()
        for name in self.book.classes:
            w = self.tracker.window(now, WINDOW_S, name)
            goodput.add_metric([name], w.goodput_rps)
            if w.requests:
                attain.add_metric([name], w.attainment)
        corr = GaugeMetricFamily(P + "latency_correction", "Observed / profile latency factor in use",
                                 labels=["worker", "phase"])  # fmt: skip
        for worker, phase, factor in self.corrections():
            corr.add_metric([worker, phase], factor)
        return [goodput, attain, corr]


class RouterMetrics:
    def __init__(
        self,
        loads: Callable[[], Iterable[WorkerLoad]],
        slos: SloBook | None = None,
        tracker: SloTracker | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        slos = slos or SloBook.of()
        slo_ttft_s, slo_tpot_s = slos.thresholds_s()
        self.corrections: Callable[[], Iterable[tuple[str, str, float]]] = list
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_with(TTFT_BUCKETS, slo_ttft_s))  # fmt: skip
        self.itl = Histogram(P + "inter_token_latency_seconds", "Gap between tokens", registry=r,
                             buckets=_with(TOKEN_BUCKETS, slo_tpot_s))  # fmt: skip
        self.tpot = Histogram(P + "request_time_per_output_token_seconds", "TPOT per request", registry=r,
                              buckets=_with(TOKEN_BUCKETS, slo_tpot_s))  # fmt: skip
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end latency", registry=r,
                             buckets=E2E_BUCKETS)  # fmt: skip
        self.queue = Histogram(P + "request_queue_time_seconds", "Arrival until prefill took the request in",
                               registry=r, buckets=TTFT_BUCKETS)  # fmt: skip
        self.prompt = Histogram(
            P + "request_prompt_tokens", "Prompt tokens", registry=r, buckets=LENGTH_BUCKETS
        )
        self.generation = Histogram(P + "request_generation_tokens", "Generated tokens", registry=r,
                                    buckets=LENGTH_BUCKETS)  # fmt: skip
        self.success = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.migrations = Counter(
            P + "request_migrations",
            "Streams moved to another decode worker: theirs was lost (cause=lost), or left its "
            "pool by a planned change whose drain ran out (cause=planned)",
            ["cause"],
            registry=r,
        )
        for cause in ("lost", "planned"):  # both series exist from the start, at 0
            self.migrations.labels(cause=cause)
        self.rerouted = Counter(
            P + "prefill_rerouted",
            "Prompts taken back from a prefill worker before they started and routed again "
            "(the prefill pool changed)",
            registry=r,
        )
        self.failures = Counter(
            P + "request_failures", "Requests that ended with an error", ["code"], registry=r
        )
        self.cached = Counter(
            P + "prefix_cache_hit_tokens", "Prompt tokens served from a prefix cache", registry=r
        )
        c = ["slo_class"]
        self.slo_requests = Counter(P + "slo_requests", "Requests judged against their SLO class (failed and "
                                    "rejected ones included)", c, registry=r)  # fmt: skip
        self.slo_ttft_met = Counter(P + "slo_ttft_met", "Requests meeting their TTFT target", c, registry=r)
        self.slo_tpot_met = Counter(P + "slo_tpot_met", "Requests meeting their TPOT target", c, registry=r)
        self.slo_met = Counter(P + "slo_met", "Requests meeting both targets (good requests)", c, registry=r)
        self.decisions = Counter(P + "router_decisions", "Routing decisions", ["policy", "outcome", "reason"],
                                 registry=r)  # fmt: skip
        self.pred_error = Histogram(P + "prediction_error_ratio", "Observed / predicted latency", ["kind"],
                                    registry=r, buckets=RATIO_BUCKETS)  # fmt: skip
        self.handoff = Histogram(P + "kv_handoff_seconds", "Prefill's first token to decode's first token",
                                 registry=r, buckets=HANDOFF_BUCKETS)  # fmt: skip
        for name in slos.classes:  # every class shows from the first scrape, at zero
            for counter in (self.slo_requests, self.slo_ttft_met, self.slo_tpot_met, self.slo_met):
                counter.labels(slo_class=name)
        self.planner_workers = Gauge(P + "planner_target_workers", "Workers the pool planner aims for",
                                     ["role"], registry=r)  # fmt: skip
        why = "Pool planner decisions (hold, scale_up, switch, scale_down, overloaded, warming)"
        self.planner_decisions = Counter(P + "planner_decisions", why, ["reason"], registry=r)
        # (monotonic t, reason, prefill, decode, detail): what /dashboard shows of the planner
        self.plans: deque[tuple[float, str, int, int, str]] = deque(maxlen=2000)
        r.register(_Workers(loads))
        r.register(_Slo(slos, tracker or SloTracker(), lambda: self.corrections()))

    def observe(self, final: Final, itls: Sequence[float]) -> None:
        t = final.timing
        self.ttft.observe(t.ttft_ms / 1000)
        if final.usage.completion_tokens > 1:
            self.tpot.observe(t.tpot_ms / 1000)
        for gap in itls:
            self.itl.observe(gap)
        self.e2e.observe(t.e2e_ms / 1000)
        self.queue.observe(t.queue_ms / 1000)
        self.prompt.observe(final.usage.prompt_tokens)
        self.generation.observe(final.usage.completion_tokens)
        self.cached.inc(final.usage.cached_tokens)
        reason = "stop" if final.finish_reason == "stop_string" else final.finish_reason
        self.success.labels(finished_reason=reason).inc()

    def failed(self, code: str) -> None:
        self.failures.labels(code=code).inc()

    def judged(self, r: SloResult) -> None:
        self.slo_requests.labels(slo_class=r.slo_class).inc()
        if r.ok:
            if r.ttft_met:
                self.slo_ttft_met.labels(slo_class=r.slo_class).inc()
            if r.tpot_met:
                self.slo_tpot_met.labels(slo_class=r.slo_class).inc()
            if r.good:
                self.slo_met.labels(slo_class=r.slo_class).inc()

    def planned(self, reason: str, prefill: int, decode: int, detail: str = "") -> None:
        self.planner_decisions.labels(reason=reason).inc()
        self.planner_workers.labels(role="prefill").set(prefill)
        self.planner_workers.labels(role="decode").set(decode)
        self.plans.append((time.monotonic(), reason, prefill, decode, detail))

    def decided(self, policy: str, outcome: str, reason: str) -> None:
        self.decisions.labels(policy=policy, outcome=outcome, reason=reason).inc()

    def prediction_error(self, kind: str, ratio: float) -> None:
        self.pred_error.labels(kind=kind).observe(ratio)
