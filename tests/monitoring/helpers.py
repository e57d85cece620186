"""Shared pieces of the monitoring tests: the files under test, external tools, PromQL names."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
RULES = MONITORING / "prometheus-rules.yml"
RULE_TESTS = MONITORING / "prometheus-rules.test.yml"
SCRAPE_CONFIG = MONITORING / "prometheus.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"

NAME = re.compile(r"pdserve:[A-Za-z0-9_:]+")
# Grafana's built-in interval variables, as a query would see them at a 1 s scrape interval.
BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_tool(*names: str, package: str) -> str:
    """The path of the first of ``names`` on PATH. Missing: the test skips on a dev machine and
    fails under CI (``.ci/run`` installs the Debian package ``package``)."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    msg = f"{' / '.join(names)} not on PATH (Debian: apt-get install {package}; .ci/run installs it)"
    if in_ci():
        pytest.fail(f"{msg}, and CI is set: the test must run", pytrace=False)
    pytest.skip(msg)


def load_rules() -> list[dict[str, Any]]:
    """Every rule of the rules file (recording and alerting), flattened."""
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {r["record"] for r in load_rules() if "record" in r}


def load_dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return board


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    out: list[dict[str, Any]] = []
    for p in board["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_exprs(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, plus the variables' queries."""
    out = [(p["title"], t["expr"]) for p in panels(board) for t in p.get("targets", []) if t.get("expr")]
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']}", q))
    return out


def variable_values(board: dict[str, Any]) -> dict[str, str]:
    """What each dashboard variable stands for in a query: its default, or the match-all regex."""
    values = dict(BUILTINS)
    for v in board["templating"]["list"]:
        if v["type"] == "datasource":
            continue
        if v.get("includeAll"):
            values[v["name"]] = v.get("allValue") or ".*"
        else:
            current = v["current"]["value"]
            values[v["name"]] = current[0] if isinstance(current, list) else current
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    """``$name`` and ``${name}`` replaced (longest names first, so $__range never eats $__rate_interval)."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    return expr


def referenced_metrics(expr: str, recorded: set[str]) -> set[str]:
    """The ``pdserve:`` series an expression reads, recording rules' outputs left out."""
    return {n for n in NAME.findall(expr) if n not in recorded}


def send_traffic(http: str, n: int, max_tokens: int = 4, api_key: str | None = None) -> None:
    """``n`` small completions, each checked (the default SLO class has no targets: all are good)."""
    from tests.service.helpers import MODEL

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    for i in range(n):
        r = httpx.post(
            f"{http}/v1/completions",
            json={"model": MODEL, "prompt": [5 + i % 50, 6, 7, 8], "max_tokens": max_tokens},
            headers=headers,
            timeout=60,
        )
        assert r.status_code == 200, r.text
