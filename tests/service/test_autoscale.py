"""``pdserve serve --autoscale`` on a real (in-process) deployment of emulated H100 workers: a
burst of long prompts makes the planner grow the pools through ``Service``, the quiet after it
shrinks them back to the minimum, and no request fails; every block and every per-request entry
is back at the end."""

from __future__ import annotations

import concurrent.futures
import time

import httpx

from pdserve.planning.autoscale import PoolAutoscaler
from pdserve.planning.planner import Planner
from pdserve.planning.planner_data import Bounds, Layout, PlannerConfig, Reason
from pdserve.steptime.roofline import H100_LLAMA3_8B
from tests.service.helpers import all_free, assert_no_request_state, start_service, status, wait_for


def prompt(k: int) -> list[int]:
    """3,000 tokens (about 80 ms of H100 prefill), no prefix shared with another request's."""
    return [k % 200 + 20, *((7 * i + k) % 200 + 20 for i in range(2999))]


def test_a_burst_grows_the_pools_and_the_quiet_shrinks_them() -> None:
    st, ep = start_service(False, prefill=1, decode=1, compute="emulated:h100-llama3-8b", local_prefill=False)
    plan = PlannerConfig(0.2, 0.05, Bounds(1, 3, 1, 2), down_after=2, cooldown=0, min_requests=5)
    scaler = PoolAutoscaler(st.service, Planner(H100_LLAMA3_8B, plan), interval_s=1.0, warmup_s=0.3)
    try:

        def one(i: int) -> int:
            body = {"model": "tiny", "prompt": prompt(i), "max_tokens": 16, "ignore_eos": True}
            r = httpx.post(f"{ep.http}/v1/completions", json=body, timeout=60)
            return r.status_code

        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            calls = [pool.submit(one, i) for i in range(48)]
            # the burst's first second at the router: far more prefill than one worker does (a
            # fixed half-second sleep saw too few arrivals when the host was slow to send them)
            window = st.service.router.accounting.window  # type: ignore[union-attr]
            wait_for(lambda: window.workload(scaler.clock(), 1.0).rate >= 20, 20, "the burst at the router")
            grew = st.run(scaler.tick())
            codes = [c.result() for c in calls]
        assert codes == [200] * 48
        assert grew.reason in (Reason.SCALE_UP, Reason.OVERLOADED, Reason.SWITCH), grew
        assert grew.layout.prefill > 1
        assert scaler.layout() == grew.layout  # the workers started and joined
        reasons = []
        details: list[object] = []
        for _ in range(12):  # the quiet: down to the minimum, never below it
            time.sleep(1.0)
            d = st.run(scaler.tick())
            reasons.append(d.reason)
            details.append((d.reason.value, d.layout, d.detail, round(d.predicted.ttft_s, 3)))
            if scaler.layout() == Layout(1, 1):
                break
        assert scaler.layout() == Layout(1, 1), details
        assert Reason.SCALE_DOWN in reasons
        metrics = httpx.get(f"{ep.http}/metrics", timeout=10).text
        assert 'pdserve:planner_decisions_total{reason="scale_down"}' in metrics
        data = httpx.get(f"{ep.http}/dashboard/data", timeout=10).json()
        assert data["planner"]["changes"][0]["reason"] == "scale_down"
        wait_for(lambda: all_free(status(ep)), 5, "blocks freed at the end")
        assert_no_request_state(st)
    finally:
        st.stop()
