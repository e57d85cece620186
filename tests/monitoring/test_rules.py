"""The Prometheus rules, their unit tests and the Grafana dashboard, checked offline (promtool)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.monitoring.helpers import (
    RULE_TESTS,
    RULES,
    SCRAPE_CONFIG,
    dashboard_exprs,
    load_dashboard,
    load_rules,
    panels,
    recorded_names,
    require_tool,
    substitute,
    variable_values,
)


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    tool = require_tool("promtool", package="prometheus")
    return subprocess.run([tool, *map(str, args)], capture_output=True, text=True, timeout=60)


def test_rules_file_is_valid() -> None:
    r = promtool("check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rule_unit_tests_pass() -> None:
    r = promtool("test", "rules", RULE_TESTS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_example_scrape_config_is_valid() -> None:
    r = promtool("check", "config", SCRAPE_CONFIG)  # loads prometheus-rules.yml beside it too
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every panel and variable query, with the variables' defaults, is valid PromQL (promtool
    parses them as the expressions of a throw-away rules file)."""
    board = load_dashboard()
    values = variable_values(board)
    rules = []
    for i, (title, expr) in enumerate(dashboard_exprs(board)):
        if expr.startswith("label_values("):  # Grafana's function: its argument is the PromQL
            expr = expr[len("label_values(") :].rsplit(",", 1)[0]
        query = substitute(expr, values)
        assert "$" not in query, f"{title}: undefined variable in {query}"
        rules.append({"record": f"dashboard:q{i}", "expr": query})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = promtool("check", "rules", path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    checked_exprs = " ".join(t["expr"] for case in tests for t in case.get("promql_expr_test", []))
    for case in tests:
        for t in case.get("alert_rule_test", []):
            (fired if t.get("exp_alerts") else quiet).add(t["alertname"])
    alerts = {r["alert"] for r in load_rules() if "alert" in r}
    assert alerts - fired == set(), "alerts never tested firing"
    assert alerts - quiet == set(), "alerts never tested staying quiet"
    used_by_alerts = {n for r in load_rules() if "alert" in r for n in re.findall(r"pdserve:\S+", r["expr"])}
    untested = {n for n in recorded_names() if n not in checked_exprs and n not in used_by_alerts}
    assert untested == set(), "recording rules whose values no test checks"


def test_dashboard_shape() -> None:
    board = load_dashboard()
    assert board["schemaVersion"] >= 39
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("ttft_slo_s", "tpot_slo_s", "slo_class"):
        assert name in variables
    all_panels = panels(board)
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in all_panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    exprs = " ".join(e for _, e in dashboard_exprs(board))
    # thresholds come from the variables, never literals
    assert not re.search(r'le="[0-9.]+"', exprs)
    assert "vector($ttft_slo_s)" in exprs and "vector($tpot_slo_s)" in exprs
    wanted = [
        "pdserve:slo_met_total",
        "pdserve:slo_ttft_met_total",
        "pdserve:slo_tpot_met_total",
        "pdserve:time_to_first_token_seconds_bucket",
        "pdserve:inter_token_latency_seconds_bucket",
        "pdserve:request_time_per_output_token_seconds_bucket",
        "pdserve:num_requests_running",
        "pdserve:num_requests_waiting",
        "pdserve:kv_cache_usage_perc",
        "pdserve:worker_healthy",
        "pdserve:worker_busy_seconds_total",
        "pdserve:kv_handoff_seconds_bucket",
        "pdserve:kv_transfer_bytes_total",
        "pdserve:kv_transfer_seconds_total",
        "pdserve:kv_transfer_failures_total",
        "pdserve:router_decisions_total",
        "pdserve:prediction_error_ratio_bucket",
        "pdserve:latency_correction",
        "pdserve:request_success_total",
        "pdserve:request_failures_total",
    ]
    assert [m for m in wanted if m not in exprs] == []
