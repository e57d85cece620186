"""A real Prometheus server (the Debian binary) scrapes a running router with the rules loaded:
goodput shows up in PromQL, every rule evaluates cleanly, every dashboard query is accepted."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from benchmarks.client import free_port
from tests.monitoring.helpers import (
    RULES,
    dashboard_exprs,
    load_dashboard,
    require_tool,
    send_traffic,
    substitute,
    variable_values,
)

DEADLINE_S = 60.0


@pytest.fixture
def prometheus(service: Any, tmp_path: Path) -> Iterator[str]:
    """Prometheus on a free loopback port, scraping the service every second; its base URL."""
    binary = require_tool("prometheus", package="prometheus")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "pdserve-router",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [urlsplit(service.http).netloc]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.console.templates=",
            "--web.console.libraries=",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def log_text() -> str:
        return (tmp_path / "prometheus.log").read_text()

    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited ({proc.returncode}):\n{log_text()}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready in 20 s:\n{log_text()}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()


def query(url: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{promql}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def scalar(url: str, promql: str) -> float:
    result = query(url, promql)
    return float(result[0]["value"][1]) if result else 0.0


def test_goodput_through_prometheus(service: Any, prometheus: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    goodput = recorded = 0.0
    # Counters only show a rate once two scrapes saw them grow: keep the traffic going until the
    # raw rate and the recording rule (evaluated every second) are both above zero.
    while time.monotonic() < deadline:
        send_traffic(service.http, 3)
        goodput = scalar(prometheus, "sum(rate(pdserve:slo_met_total[1m]))")
        recorded = scalar(prometheus, "sum(pdserve:goodput:rate1m)")
        if goodput > 0 and recorded > 0:
            break
        time.sleep(0.2)
    up = query(prometheus, 'up{job="pdserve-router"}')
    assert up and up[0]["value"][1] == "1", f"scrape target: {up}"
    assert goodput > 0, "no goodput in Prometheus within the deadline"
    assert recorded > 0, "pdserve:goodput:rate1m never became positive"
    attainment = query(prometheus, "pdserve:slo_attainment:ratio_rate5m")
    assert attainment and all(float(s["value"][1]) == 1.0 for s in attainment), attainment

    # Every rule group loaded and each rule evaluated without error.
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=5).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] not in ("ok", "unknown")]
    assert bad == []
    firing = [r["name"] for r in rules if r["type"] == "alerting" and r["state"] == "firing"]
    assert firing == [], "a healthy deployment meeting its SLO fires no alert"

    # The dashboard's queries, with the variables' defaults, run on this server.
    board = load_dashboard()
    values = variable_values(board)
    for _, expr in dashboard_exprs(board):
        if not expr.startswith("label_values("):
            query(prometheus, substitute(expr, values))
    goodput_panel = next(e for t, e in dashboard_exprs(board) if t.startswith("Goodput"))
    assert query(prometheus, substitute(goodput_panel, values)), "the goodput panel shows nothing"
