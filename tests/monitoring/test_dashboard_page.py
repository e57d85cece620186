"""``/dashboard``: its JSON (NaN as null, behind the API key) and the page drawn by headless Chromium."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from matplotlib.image import imread

from tests.monitoring.helpers import require_tool, send_traffic


def fake_router(tracker: Any) -> Any:
    """What the dashboard reads of a router: its SLO classes and tracker, workers and model id."""
    from pdserve.router.config import Caps
    from pdserve.router.slo import SloBook, SloClass
    from pdserve.worker.messages import WorkerHealth, WorkerLoad, WorkerRole

    def worker(wid: str, role: WorkerRole, free: int, health: WorkerHealth) -> Any:
        load = WorkerLoad(wid, role, "", 1, 2, 100, free, 0)
        routable = health is WorkerHealth.HEALTHY
        info = SimpleNamespace(tp=2 if role is WorkerRole.DECODE else 1)
        return SimpleNamespace(
            worker_id=wid, role=role, load=load, health=health, routable=routable, info=info
        )

    workers = [
        worker("decode-0", WorkerRole.DECODE, 25, WorkerHealth.HEALTHY),
        worker("prefill-0", WorkerRole.PREFILL, 100, WorkerHealth.UNHEALTHY),
    ]
    return SimpleNamespace(
        slos=SloBook.of(SloClass("chat", ttft_ms=250, tpot_ms=100), SloClass("batch", ttft_ms=2000)),
        slo_tracker=tracker,
        plans=[],
        workers={w.worker_id: w for w in workers},
        model=SimpleNamespace(model_id="tiny", vocab_size=256),
        config=SimpleNamespace(caps=Caps()),
        ready=True,
    )


def test_data_json_nan_is_null_and_behind_the_key() -> None:
    from pdserve.router.chat import ChatTemplate
    from pdserve.router.openai_api import build_http_app
    from pdserve.router.slo import SloResult, SloTracker

    tracker = SloTracker()
    now = time.monotonic()
    for i in range(10):  # 'chat' ended requests in the last minute; the first 30 s of the horizon are empty
        tracker.record(SloResult(now - 50 + i, "chat", 80.0 + i, 20.0, True, i % 5 != 0, True))
    app = build_http_app(fake_router(tracker), ChatTemplate(None), api_key="sekrit")
    client = TestClient(app)
    assert client.get("/health").status_code == 200
    assert client.get("/dashboard/data").status_code == 401
    auth = {"Authorization": "Bearer sekrit"}
    page = client.get("/dashboard")  # the page itself is open: a browser cannot send the header
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="goodput"' in page.text and "dataset.ready" in page.text
    external = re.search(r"""(src|href)=["']?(https?:)?//""", page.text)
    assert not external, "the page loads nothing from elsewhere"

    r = client.get("/dashboard/data", params={"horizon_s": 120, "step_s": 10}, headers=auth)
    assert r.status_code == 200
    assert "NaN" not in r.text and "Infinity" not in r.text
    d = r.json()
    assert len(d["series"]) == 12 and d["series"][-1]["t"] == 0
    assert d["series"][0]["attainment"] is None  # no request ended 110-120 s ago
    assert d["series"][0]["ttft_p50_ms"] is None and d["series"][0]["requests"] == 0
    chat, batch = d["classes"]["chat"], d["classes"]["batch"]
    assert chat["requests"] == 10 and chat["good"] == 8 and chat["attainment"] == pytest.approx(0.8)
    assert chat["goodput_rps"] == pytest.approx(8 / 60)
    assert chat["targets"] == {"ttft_ms": 250, "tpot_ms": 100}
    assert batch["targets"] == {"ttft_ms": 2000, "tpot_ms": None}
    assert batch["requests"] == 0 and batch["attainment"] is None  # configured, no traffic yet
    assert {k: v for k, v in chat.items() if k != "targets"} == d["current"]
    load = {"running": 1, "waiting": 2}
    assert d["workers"] == [
        {"worker": "decode-0", "role": "decode", "tp": 2, "healthy": True, "health": "healthy", **load,
         "kv_usage": 0.75},
        {"worker": "prefill-0", "role": "prefill", "tp": 1, "healthy": False, "health": "unhealthy", **load,
         "kv_usage": 0.0},
    ]  # fmt: skip
    assert client.get("/dashboard/data", params={"step_s": 0}, headers=auth).status_code == 400
    assert d["planner"] is None  # no planner running: no pools panel


def test_data_json_shows_the_planners_pools_and_changes() -> None:
    from pdserve.router.chat import ChatTemplate
    from pdserve.router.openai_api import build_http_app
    from pdserve.router.slo import SloTracker

    router = fake_router(SloTracker())
    now = time.monotonic()
    router.plans = [
        (now - 95, "hold", 1, 1, ""),
        (now - 55, "scale_up", 3, 2, "attainment 0.7 < 0.9"),
        (now - 25, "hold", 3, 2, ""),
        (now - 5, "scale_down", 2, 2, "met with margin"),
    ]
    client = TestClient(build_http_app(router, ChatTemplate(None)))
    d = client.get("/dashboard/data", params={"horizon_s": 120, "step_s": 10}).json()
    plan = d["planner"]
    assert plan["prefill"][:2] == [None, None] and plan["prefill"][3] == 1  # before the first decision
    assert plan["prefill"][-1] == 2 and plan["decode"][-1] == 2 and plan["prefill"][-4] == 3
    assert [c["reason"] for c in plan["changes"]] == [
        "scale_down",
        "scale_up",
    ]  # newest first, holds left out
    assert plan["changes"][1] | {"t": 0} == {"t": 0, "reason": "scale_up", "prefill": 3, "decode": 2,
                                              "detail": "attainment 0.7 < 0.9"}  # fmt: skip


def chromium(binary: str, tmp: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """One headless Chromium run (offline flags, its own profile), killed with its children on timeout."""
    cmd = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        f"--user-data-dir={tmp / 'profile'}",
        "--window-size=1280,900",
        "--virtual-time-budget=8000",
        *args,
        url,
    ]
    pipe = subprocess.PIPE
    proc = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"chromium did not finish in 60 s: {err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_dashboard_renders_in_chromium(service: Any, tmp_path: Path) -> None:
    binary = require_tool("chromium", "chromium-browser", package="chromium")
    send_traffic(service.http, 6)
    url = f"{service.http}/dashboard"

    dom = chromium(binary, tmp_path, url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert re.search(r'<body[^>]*data-ready="1"', dom.stdout), "the page never rendered its data"
    goodput = re.search(r'id="goodput">([^<]*)<', dom.stdout)
    assert goodput and goodput.group(1).strip() not in ("", "–"), "no goodput value"
    assert float(goodput.group(1)) > 0
    paths = re.findall(r'<path d="M[^"]+"', dom.stdout)
    assert len(paths) >= 4, "charts without lines"

    shot = tmp_path / "dashboard.png"
    run = chromium(binary, tmp_path, url, f"--screenshot={shot}")
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    assert shot.stat().st_size > 20_000
    img = imread(shot)
    assert img.shape[:2] == (900, 1280)
    rgb = (img[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3)
    colours = np.unique(rgb, axis=0)
    assert len(colours) > 50, "a near-uniform screenshot"
    # the goodput line (#1a9e55) is drawn
    green = np.all(np.abs(rgb.astype(int) - (0x1A, 0x9E, 0x55)) <= 8, axis=1).sum()
    assert green > 100, f"only {green} pixels of the goodput line"
    assert not math.isnan(float(img.mean()))


class Cdp:
    """Chrome DevTools Protocol over the page's websocket: evaluate JavaScript, read the result."""

    def __init__(self, port: int, url: str) -> None:
        import httpx
        import websocket

        deadline = time.monotonic() + 30
        while True:
            try:
                pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
                page = next(p for p in pages if p.get("type") == "page" and p["url"].startswith(url))
                break
            except (httpx.HTTPError, StopIteration, ValueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=10)
        self.next_id = 0

    def eval(self, expression: str) -> Any:
        import json

        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": "Runtime.evaluate",
                                 "params": {"expression": expression, "returnByValue": True}}))  # fmt: skip
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                return msg["result"]["result"].get("value")

    def wait(self, expression: str, timeout_s: float = 20) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"not true within {timeout_s}s: {expression}")


def test_dashboard_with_an_api_key_in_a_browser(tmp_path: Path) -> None:
    """With --api-key, a browser opens /dashboard (no header needed), the page asks for the key,
    and once it is typed in the data loads; the key is sent as a header, never in a URL."""
    import httpx

    pytest.importorskip("websocket")
    from benchmarks.client import free_port
    from tests.service.helpers import running_service

    binary = require_tool("chromium", "chromium-browser", package="chromium")
    client = httpx.Client(headers={"Authorization": "Bearer s3cret-key"})
    with client, running_service(http_client=client, use_ray=False, api_key="s3cret-key") as (_, ep):
        send_traffic(ep.http, 4, api_key="s3cret-key")
        port = free_port()
        url = f"{ep.http}/dashboard"
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-extensions", f"--user-data-dir={tmp_path / 'profile'}",
               f"--remote-debugging-port={port}", "--remote-allow-origins=*", url]  # fmt: skip
        quiet = subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=quiet, stderr=quiet, start_new_session=True)
        try:
            page = Cdp(port, url)
            page.wait("document.getElementById('auth').classList.contains('shown')")
            assert page.eval("document.body.dataset.ready") is None  # nothing shown without the key
            page.eval("document.getElementById('key').value = 's3cret-key'; "
                      "document.getElementById('auth').requestSubmit(); true")  # fmt: skip
            page.wait("document.body.dataset.ready === '1'")
            goodput = page.eval("document.getElementById('goodput').textContent")
            assert float(goodput) > 0, goodput
            assert not page.eval("document.getElementById('auth').classList.contains('shown')")
            urls = page.eval("performance.getEntries().map(e => e.name).join(' ')")
            assert "dashboard/data" in urls and "s3cret" not in urls
            assert page.eval("location.href") == url
            page.ws.close()
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
