"""Prometheus metrics of the router, named as vLLM names them under the ``pdserve:`` prefix.

Request metrics are observed once per request when it ends (TTFT, TPOT, ITL, E2E, queue time,
token counts, success by finish reason, failures by status code); worker gauges (running,
waiting, KV usage, health) are read at scrape time from the load each worker last reported. The
registry belongs to one router, so several routers (tests) never share series. Histogram buckets
follow vLLM's and can be extended with SLO thresholds, so attainment can be charted exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from model_runtime.worker.messages import WorkerHealth, WorkerLoad
from router.stream import Final

P = "pdserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


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
        for w in self.loads():
            labels = [w.worker_id, w.role.value]
            running.add_metric(labels, w.running)
            waiting.add_metric(labels, w.waiting)
            kv.add_metric(labels, w.kv_usage)
            healthy.add_metric(labels, 1.0 if w.health is WorkerHealth.HEALTHY else 0.0)
        return [running, waiting, kv, healthy]


class RouterMetrics:
    def __init__(
        self,
        loads: Callable[[], Iterable[WorkerLoad]],
        slo_ttft_s: Iterable[float] = (),
        slo_tpot_s: Iterable[float] = (),
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_with(TTFT_BUCKETS, slo_ttft_s))  # fmt: skip
        self.itl = Histogram(P + "inter_token_latency_seconds", "Gap between tokens", registry=r,
                             buckets=_with(TOKEN_BUCKETS, slo_tpot_s))  # fmt: skip
        self.tpot = Histogram(P + "request_time_per_output_token_seconds", "TPOT per request", registry=r,
                              buckets=_with(TOKEN_BUCKETS, slo_tpot_s))  # fmt: skip
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end latency", registry=r,
                             buckets=E2E_BUCKETS)  # fmt: skip
        self.queue = Histogram(P + "request_queue_time_seconds", "Arrival to dispatch", registry=r,
                               buckets=TTFT_BUCKETS)  # fmt: skip
        self.prompt = Histogram(
            P + "request_prompt_tokens", "Prompt tokens", registry=r, buckets=LENGTH_BUCKETS
        )
        self.generation = Histogram(P + "request_generation_tokens", "Generated tokens", registry=r,
                                    buckets=LENGTH_BUCKETS)  # fmt: skip
        self.success = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.failures = Counter(
            P + "request_failures", "Requests that ended with an error", ["code"], registry=r
        )
        self.cached = Counter(
            P + "prefix_cache_hit_tokens", "Prompt tokens served from a prefix cache", registry=r
        )
        r.register(_Workers(loads))

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
