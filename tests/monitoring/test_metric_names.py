"""Every series the dashboard and the rules read exists on a real router's /metrics."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.monitoring.helpers import (
    RULE_TESTS,
    dashboard_exprs,
    load_dashboard,
    load_rules,
    recorded_names,
    referenced_metrics,
    send_traffic,
)

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
}


def exposed_names(text: str) -> set[str]:
    """Every series name a scrape of ``text`` can produce, including those of labelled metrics
    that have no sample yet (prometheus_client still writes their HELP and TYPE lines)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


def test_exposed_names_parser() -> None:
    text = (
        "# HELP pdserve:x_total x\n# TYPE pdserve:x_total counter\n"
        "# HELP pdserve:h h\n# TYPE pdserve:h histogram\n"
        '# HELP pdserve:g g\n# TYPE pdserve:g gauge\npdserve:g{worker="a"} 1.0\n'
    )
    names = exposed_names(text)
    assert {"pdserve:x_total", "pdserve:h_bucket", "pdserve:h_count", "pdserve:g"} <= names
    assert "pdserve:h" not in names and "pdserve:x" not in names
    recorded = {"pdserve:goodput:rate1m"}
    expr = 'sum(rate(pdserve:h_bucket{le="0.1"}[5m])) / pdserve:goodput:rate1m + pdserve:g'
    assert referenced_metrics(expr, recorded) == {"pdserve:h_bucket", "pdserve:g"}


@pytest.fixture(scope="module")
def metrics_text(service: Any) -> str:
    send_traffic(service.http, 2)
    r = httpx.get(f"{service.http}/metrics", timeout=10)
    r.raise_for_status()
    return r.text


def _where_used() -> dict[str, set[str]]:
    recorded = recorded_names()
    used: dict[str, set[str]] = {}
    for title, expr in dashboard_exprs(load_dashboard()):
        for name in referenced_metrics(expr, recorded):
            used.setdefault(name, set()).add(f"dashboard: {title}")
    for rule in load_rules():
        for name in referenced_metrics(rule["expr"], recorded):
            used.setdefault(name, set()).add(f"rule {rule.get('record') or rule.get('alert')}")
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for series in case.get("input_series", []):
            for name in referenced_metrics(series["series"].split("{")[0], recorded):
                used.setdefault(name, set()).add(f"rule test: {case['name']}")
    return used


def test_every_referenced_metric_is_exported(metrics_text: str) -> None:
    exposed = exposed_names(metrics_text)
    used = _where_used()
    assert len(used) > 20
    missing = [f"  {name}  (used by {'; '.join(sorted(where)[:2])})" for name, where in sorted(used.items())
               if name not in exposed]  # fmt: skip
    if missing:
        pytest.fail("referenced but not on the router's /metrics:\n" + "\n".join(missing), pytrace=False)
