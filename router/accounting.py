"""What the router learns from each request's life, and who it tells (no I/O).

The dispatcher hears about first tokens and ends (its ledger and latency
corrections depend on them); Prometheus metrics observe every decision and every end; and
each request that ends — or is refused — is judged against its SLO class, for the
``slo_*`` counters and the live window behind ``/dashboard``. A client that went away
(abort, CANCELLED) gets no verdict: it is neither good nor bad service.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable

from pdserve.router.config import RouterConfig
from pdserve.router.dispatchers import make_dispatcher
from pdserve.router.errors import Code
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import Decision
from pdserve.router.predictor import Phase
from pdserve.router.slo import SloBook, SloClass, SloResult, SloTracker
from pdserve.router.stream import RequestStream, Timing
from pdserve.router.workload_window import WorkloadWindow
from pdserve.worker.messages import TokenDelta, WorkerLoad, WorkerRole

log = logging.getLogger(__name__)


class Accounting:
    def __init__(
        self,
        config: RouterConfig,
        block_size: int,
        loads: Callable[[], Iterable[WorkerLoad]],
        local_step_tokens: int = 0,
        prefill_step_tokens: int = 0,
    ) -> None:
        self.slos = SloBook.of(*config.slo_classes, default=config.default_slo_class or None)
        self.tracker = SloTracker()
        self.window = WorkloadWindow()  # what the pool planner sizes the pools for
        self.metrics = RouterMetrics(loads, self.slos, self.tracker)
        self.dispatcher = make_dispatcher(
            config.policy, config.latency_profile, block_size, config.local_prefill,
            on_error=self.metrics.prediction_error, local_step_tokens=local_step_tokens,
            prefill_step_tokens=prefill_step_tokens, prefill_profile=config.prefill_latency_profile,
        )  # fmt: skip
        model = getattr(self.dispatcher, "model", None)
        if model is not None:
            self.metrics.corrections = lambda: [
                (key, phase.value, f) for key, phase, f in model.corrections() if phase is not Phase.TRANSFER
            ]

    def decided(self, request_id: str, decision: Decision) -> None:
        self.metrics.decided(self.dispatcher.name, decision.outcome.value, decision.reason)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: %s (%s) prefill=%s decode=%s predicted ttft=%.1fms tpot=%.2fms",
                request_id, decision.outcome.value, decision.reason, decision.prefill_worker or "-",
                decision.decode_worker, decision.predicted_ttft_s * 1e3, decision.predicted_tpot_s * 1e3,
            )  # fmt: skip

    def on_delta(self, role: WorkerRole, stream: RequestStream, d: TokenDelta) -> None:
        """Before ``stream`` takes ``d``: the first token (TTFT) goes to the dispatcher; decode's
        first token after a remote prefill gives the KV hand-off gap (a metric)."""
        if not d.token_ids:
            return
        now = time.perf_counter()
        if stream.first_token is None:
            # From this attempt's dispatch: what the dispatcher predicted (a prompt routed again
            # waited elsewhere before).
            self.dispatcher.on_first_token(stream.request_id, now, now - stream.attempt_at)
        elif role is not WorkerRole.PREFILL and stream.prefill_worker and not stream.handed_off:
            stream.handed_off = True
            # The KV can move only once prefill is done and decode has reserved room for it: a
            # wait for room is decode's queue, not the link's.
            gap = now - max(stream.first_token, stream.reserved_at)
            self.metrics.handoff.observe(gap)

    def ended(self, slo: SloClass, stream: RequestStream) -> None:
        now = time.perf_counter()
        itls = stream.itls[1:] if stream.prefill_worker else stream.itls  # less the hand-off gap
        self.dispatcher.on_end(stream.request_id, now, statistics.median(itls) if itls else None)
        if stream.final_event is not None:
            usage = stream.final_event.usage
            self.window.ended(
                time.monotonic(), usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
            )
            self.metrics.observe(stream.final_event, stream.itls)
            if stream.final_event.finish_reason != "abort":
                self.judge(slo, stream.final_event.timing)
        elif stream.error is not None:
            self.metrics.failed(stream.error.code.name)
            if stream.error.code is not Code.CANCELLED:
                self.judge(slo, None)

    def dropped(self, request_id: str) -> None:
        """An admitted request that will not run (nothing was sent for it)."""
        self.dispatcher.on_end(request_id, time.perf_counter(), None)

    def judge(self, slo: SloClass, timing: Timing | None) -> None:
        """One request against its class; ``None``: it failed or was refused (a miss)."""
        now = time.monotonic()
        if timing is None:
            result = SloResult(now, slo.name, 0.0, 0.0, False, False, ok=False)
        else:
            ttft_met, tpot_met = slo.met(timing.ttft_ms, timing.tpot_ms)
            arrival = now - timing.e2e_ms / 1000  # the planner tells layouts apart by it
            result = SloResult(
                now, slo.name, timing.ttft_ms, timing.tpot_ms, ttft_met, tpot_met, True, arrival
            )
        self.tracker.record(result)
        self.metrics.judged(result)
