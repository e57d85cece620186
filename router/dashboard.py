"""``GET /dashboard``: a live page of the router's goodput, SLO attainment and latency percentiles.

The page is one self-contained HTML document (inline CSS, JS and SVG charts; nothing is loaded
from elsewhere, so it works offline) that polls ``GET /dashboard/data`` every 2 s. The data comes
from the router's own ``SloTracker`` (the outcomes of the last minutes), its SLO classes'
targets and the load its workers last reported, so it needs no Prometheus server. With
``--api-key`` the data sits behind the key like every route but ``/health``; the page itself is
open (``PAGE_PATH``: a static document that holds no data), because a browser cannot add an
``Authorization`` header to a page it opens: it asks for the key on a 401, keeps it in the
browser's ``localStorage`` and sends it as a header with its data requests, so the key never
appears in a URL or a server log.

Computing the data walks the tracker's outcomes once per step, on the event loop, so a payload
is reused for ``CACHE_S`` whoever asks (several open pages cost one computation).
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse, JSONResponse

from pdserve.router.service import Router
from pdserve.router.slo import WindowStats

PAGE_PATH = "/dashboard"  # open even with an API key (see above); its data is not
WINDOW_S = 60.0  # the "current" numbers: the last minute, like the router's gauges
MAX_POINTS = 300
CACHE_S = 1.0


def _finite(x: Any) -> Any:
    """NaN and infinities as ``None`` (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _stats(w: WindowStats, now: float) -> dict[str, Any]:
    d = {k: _finite(v) for k, v in asdict(w).items()}
    d["t"] = round(w.t - now, 3)  # seconds relative to now (<= 0)
    return d


def dashboard_data(router: Router, horizon_s: float, step_s: float) -> dict[str, Any]:
    """What ``/dashboard/data`` returns (NaN already turned into ``None``)."""
    tracker = router.slo_tracker
    now = time.monotonic()
    horizon_s = min(horizon_s, tracker.horizon_s)
    step_s = max(step_s, horizon_s / MAX_POINTS)
    series = tracker.series(now, horizon_s, step_s)
    workers = []
    for w in sorted(router.workers.values(), key=lambda w: w.worker_id):
        load = w.load
        workers.append(
            {
                "worker": w.worker_id,
                "role": w.role.value,
                "tp": w.info.tp,
                "healthy": w.routable,
                "health": w.health.value,
                "running": load.running,
                "waiting": load.waiting,
                "kv_usage": _finite(load.kv_usage),
            }
        )
    book = router.slos.classes
    targets = {name: {"ttft_ms": c.ttft_ms or None, "tpot_ms": c.tpot_ms or None} for name, c in book.items()}
    return {
        "model": router.model.model_id,
        "time": time.time(),
        "horizon_s": horizon_s,
        "step_s": step_s,
        "window_s": WINDOW_S,
        "series": [_stats(w, now) for w in series],
        "current": _stats(tracker.window(now, WINDOW_S), now),
        "classes": {
            c: _stats(tracker.window(now, WINDOW_S, c), now) | {"targets": targets.get(c)}
            for c in sorted({*book, *tracker.classes()})
        },
        "workers": workers,
        "planner": _planner(router, series, now),
    }


def _planner(router: Router, series: list[WindowStats], now: float) -> dict[str, Any] | None:
    """The pool planner's targets at each point of the series, and its recent changes (``None``
    when it is not running)."""
    plans = list(router.plans)
    if not plans:
        return None
    times = [p[0] for p in plans]
    at = [plans[i - 1] if (i := bisect.bisect_right(times, w.t)) else None for w in series]
    changes = [p for p in plans if p[1] not in ("hold", "warming")][-20:]
    return {
        "prefill": [p[2] if p else None for p in at],
        "decode": [p[3] if p else None for p in at],
        "changes": [
            {"t": round(t - now, 1), "reason": r, "prefill": pf, "decode": dc, "detail": detail}
            for t, r, pf, dc, detail in reversed(changes)
        ],
    }


def install_dashboard(app: FastAPI, router: Router) -> None:
    """Add ``GET /dashboard`` (the page) and ``GET /dashboard/data`` (its JSON) to ``app``."""
    cache: dict[tuple[float, float], tuple[float, dict[str, Any]]] = {}

    @app.get(PAGE_PATH, response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/data", include_in_schema=False)
    async def data(
        horizon_s: float = Query(300.0, ge=10.0, le=3600.0),
        step_s: float = Query(5.0, ge=1.0, le=600.0),
    ) -> JSONResponse:
        key = (horizon_s, step_s)
        now = time.monotonic()
        hit = cache.get(key)
        if hit is None or now - hit[0] > CACHE_S:
            cache.clear()  # one entry: the page always asks the same
            hit = cache[key] = (now, dashboard_data(router, horizon_s, step_s))
        return JSONResponse(hit[1], headers={"Cache-Control": "no-store"})


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>pdserve dashboard</title>
<style>
  :root { --fg: #1d2330; --muted: #6b7385; --line: #e3e6ec; --bg: #f6f7f9; --card: #fff;
          --good: #1a9e55; --bad: #d64545; --c1: #2f6fde; --c2: #e0802f; --c3: #8a4fd1; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
         color: var(--fg); background: var(--bg); }
  header { display: flex; align-items: baseline; gap: 16px; padding: 14px 20px;
           background: var(--card); border-bottom: 1px solid var(--line); }
  header h1 { font-size: 18px; margin: 0; }
  header .sub { color: var(--muted); }
  header #status { margin-left: auto; color: var(--muted); font-size: 12px; }
  header #status.error { color: var(--bad); }
  main { padding: 16px 20px; display: grid; gap: 16px; }
  .cards { display: grid; grid-template-columns: repeat(5, 1fr); gap: 12px; }
  .card, .panel { background: var(--card); border: 1px solid var(--line); border-radius: 6px; }
  .card { padding: 10px 14px; }
  .card .label { color: var(--muted); font-size: 12px; }
  .card .value { font-size: 26px; font-weight: 600; font-variant-numeric: tabular-nums; }
  .card .unit { font-size: 13px; color: var(--muted); font-weight: 400; margin-left: 4px; }
  .charts { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
  .panel { padding: 8px 12px 10px; }
  .panel h2 { font-size: 13px; margin: 2px 0 4px; font-weight: 600; }
  svg.chart { width: 100%; height: 190px; display: block; }
  svg text { font-size: 10px; fill: var(--muted); font-variant-numeric: tabular-nums; }
  .legend { display: flex; gap: 14px; font-size: 12px; color: var(--muted); }
  .legend i { display: inline-block; width: 10px; height: 3px; margin-right: 5px; vertical-align: middle; }
  .tables { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
  table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
  th, td { text-align: right; padding: 3px 6px; border-bottom: 1px solid var(--line); }
  th:first-child, td:first-child { text-align: left; }
  th { color: var(--muted); font-weight: 500; font-size: 12px; }
  .ok { color: var(--good); } .down { color: var(--bad); }
  .bar { display: inline-block; height: 8px; background: var(--c1); border-radius: 2px;
         vertical-align: middle; }
  #auth { display: none; gap: 8px; align-items: center; }
  #auth.shown { display: flex; }
</style>
</head>
<body>
<header>
  <h1>pdserve</h1><span class="sub" id="model"></span>
  <form id="auth"><span>API key</span><input id="key" type="password" autocomplete="off">
    <button type="submit">Use key</button></form>
  <span id="status">loading…</span>
</header>
<main>
  <section class="cards">
    <div class="card"><div class="label">Goodput (last 60 s)</div>
      <div class="value"><span id="goodput">–</span><span class="unit">req/s</span></div></div>
    <div class="card"><div class="label">SLO attainment (joint)</div>
      <div class="value"><span id="attainment">–</span></div></div>
    <div class="card"><div class="label">TTFT p50 / p99</div>
      <div class="value"><span id="ttft">–</span><span class="unit">ms</span></div></div>
    <div class="card"><div class="label">TPOT p50 / p99</div>
      <div class="value"><span id="tpot">–</span><span class="unit">ms</span></div></div>
    <div class="card"><div class="label">Requests ended (last 60 s)</div>
      <div class="value"><span id="requests">–</span></div></div>
  </section>
  <section class="charts">
    <div class="panel"><h2>Goodput (req/s)</h2><svg class="chart" id="c-goodput"></svg>
      <div class="legend" id="l-goodput"></div></div>
    <div class="panel"><h2>SLO attainment</h2><svg class="chart" id="c-attainment"></svg>
      <div class="legend" id="l-attainment"></div></div>
    <div class="panel"><h2>TTFT (ms)</h2><svg class="chart" id="c-ttft"></svg>
      <div class="legend" id="l-ttft"></div></div>
    <div class="panel"><h2>TPOT (ms)</h2><svg class="chart" id="c-tpot"></svg>
      <div class="legend" id="l-tpot"></div></div>
    <div class="panel" id="p-pools" hidden><h2>Pools (planner's target workers)</h2>
      <svg class="chart" id="c-pools"></svg><div class="legend" id="l-pools"></div></div>
  </section>
  <section class="tables">
    <div class="panel"><h2>SLO classes (last 60 s)</h2>
      <table><thead><tr><th>class</th><th>targets (ms)</th><th>requests</th><th>good</th><th>goodput</th>
        <th>attainment</th><th>TTFT p50/p99</th><th>TPOT p50/p99</th></tr></thead>
        <tbody id="classes"></tbody></table></div>
    <div class="panel"><h2>Workers</h2>
      <table><thead><tr><th>worker</th><th>role</th><th>TP</th><th>health</th><th>running</th><th>waiting</th>
        <th>KV usage</th></tr></thead><tbody id="workers"></tbody></table></div>
    <div class="panel" id="p-changes" hidden><h2>Planner changes</h2>
      <table><thead><tr><th>when</th><th>change</th><th>to</th><th>why</th></tr></thead>
        <tbody id="changes"></tbody></table></div>
  </section>
</main>
<script>
"use strict";
const POLL_MS = 2000;
const KEY = "pdserve-api-key";
const NS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

function num(v, digits) {
  return v === null || v === undefined ? "–" : Number(v).toFixed(digits);
}
function pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %"; }
function ms(v) { return v === null || v === undefined ? "–" : (v < 10 ? v.toFixed(1) : v.toFixed(0)); }
function pair(a, b) { return ms(a) + " / " + ms(b); }
function el(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
// the smallest 1, 2, 2.5 or 5 times a power of ten that is >= x
function nice(x) {
  if (!(x > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(x)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

// lines: [{name, color, values: [y or null]}], xs: seconds relative to now (<= 0)
function chart(id, xs, lines, opts) {
  const svg = $("c-" + id);
  const W = svg.clientWidth || 600, H = svg.clientHeight || 190;
  const L = 44, R = 8, T = 8, B = 20;
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  svg.replaceChildren();
  let ymax = opts.max;
  if (ymax === undefined) {
    ymax = 0;
    for (const l of lines) for (const v of l.values) if (v !== null && v > ymax) ymax = v;
    ymax = 4 * nice(ymax * 1.1 / 4);  // four round grid steps
  }
  const x0 = xs.length ? xs[0] : -300, x1 = 0;
  const sx = (x) => L + (W - L - R) * (x - x0) / ((x1 - x0) || 1);
  const sy = (y) => T + (H - T - B) * (1 - y / ymax);
  for (let i = 0; i <= 4; i++) {
    const y = ymax * i / 4;
    svg.append(el("line", {x1: L, x2: W - R, y1: sy(y), y2: sy(y), stroke: "#e3e6ec"}));
    svg.append(el("text", {x: L - 4, y: sy(y) + 3, "text-anchor": "end"}, opts.fmt(y)));
  }
  const span = x1 - x0, tick = span > 600 ? 300 : span > 120 ? 60 : 15;
  for (let x = 0; x >= x0; x -= tick) {
    const label = x === 0 ? "now" : (x % 60 === 0 ? (x / 60) + " min" : x + " s");
    svg.append(el("text", {x: sx(x), y: H - 5, "text-anchor": x === 0 ? "end" : "middle"}, label));
  }
  const gap = (v) => v === null || v === undefined;
  for (const l of lines) {
    let d = "";
    l.values.forEach((v, i) => {
      if (gap(v)) return;
      const x = sx(xs[i]), y = sy(Math.min(v, ymax));
      d += (i > 0 && !gap(l.values[i - 1]) ? "L" : "M") + x.toFixed(1) + " " + y.toFixed(1);
      if ((i === 0 || gap(l.values[i - 1])) && (i === l.values.length - 1 || gap(l.values[i + 1]))) {
        svg.append(el("circle", {cx: x, cy: y, r: 2.5, fill: l.color}));  // a lone point
      }
    });
    if (d) svg.append(el("path", {d: d, fill: "none", stroke: l.color, "stroke-width": 2,
                                   "stroke-linejoin": "round", "stroke-dasharray": l.dash || ""}));
  }
  const legend = $("l-" + id);
  legend.replaceChildren();
  for (const l of lines) {
    const s = document.createElement("span");
    const i = document.createElement("i");
    i.style.background = l.color;
    s.append(i, l.name);
    legend.append(s);
  }
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = document.createElement("td");
    if (c instanceof Node) td.append(c); else td.textContent = c;
    tr.append(td);
  }
  return tr;
}

function render(d) {
  $("model").textContent = d.model + " · windows of " + d.step_s + " s over the last " +
    Math.round(d.horizon_s / 60) + " min";
  const c = d.current;
  $("goodput").textContent = num(c.goodput_rps, 2);
  $("attainment").textContent = pct(c.attainment);
  $("ttft").textContent = pair(c.ttft_p50_ms, c.ttft_p99_ms);
  $("tpot").textContent = pair(c.tpot_p50_ms, c.tpot_p99_ms);
  $("requests").textContent = String(c.requests);
  const xs = d.series.map((s) => s.t), col = (k) => d.series.map((s) => s[k]);
  const css = getComputedStyle(document.documentElement), v = (n) => css.getPropertyValue(n).trim();
  chart("goodput", xs, [
    {name: "all ended requests", color: v("--muted"), dash: "4 3",
     values: d.series.map((s) => s.requests / d.step_s)},
    {name: "goodput", color: v("--good"), values: col("goodput_rps")}],
    {fmt: (y) => y.toFixed(y < 10 ? 1 : 0)});
  chart("attainment", xs, [{name: "joint attainment", color: v("--c1"), values: col("attainment")}],
        {max: 1, fmt: (y) => (100 * y).toFixed(0) + "%"});
  // one dashed line per distinct target of the configured classes
  const targetLines = (key) => {
    const seen = new Map();
    for (const [name, s] of Object.entries(d.classes)) {
      const t = s.targets && s.targets[key];
      if (t) seen.set(t, (seen.has(t) ? seen.get(t) + ", " : "") + name);
    }
    return [...seen].map(([t, names]) => ({name: "target " + ms(t) + " ms (" + names + ")",
      color: v("--bad"), dash: "6 4", values: xs.map(() => t)}));
  };
  chart("ttft", xs, [{name: "p50", color: v("--c1"), values: col("ttft_p50_ms")},
                     {name: "p99", color: v("--c2"), values: col("ttft_p99_ms")},
                     ...targetLines("ttft_ms")], {fmt: (y) => ms(y)});
  chart("tpot", xs, [{name: "p50", color: v("--c1"), values: col("tpot_p50_ms")},
                     {name: "p99", color: v("--c2"), values: col("tpot_p99_ms")},
                     ...targetLines("tpot_ms")], {fmt: (y) => ms(y)});
  const classes = $("classes");
  classes.replaceChildren();
  for (const [name, s] of Object.entries(d.classes)) {
    const t = s.targets || {};
    const target = (t.ttft_ms || t.tpot_ms) ? ms(t.ttft_ms) + " / " + ms(t.tpot_ms) : "none";
    classes.append(row([name, target, String(s.requests), String(s.good), num(s.goodput_rps, 2),
                        pct(s.attainment), pair(s.ttft_p50_ms, s.ttft_p99_ms),
                        pair(s.tpot_p50_ms, s.tpot_p99_ms)]));
  }
  const plan = d.planner;
  $("p-pools").hidden = $("p-changes").hidden = !plan;
  if (plan) {
    chart("pools", xs, [{name: "prefill", color: v("--c1"), values: plan.prefill},
                        {name: "decode", color: v("--c2"), values: plan.decode}],
          {fmt: (y) => y.toFixed(0)});
    const changes = $("changes");
    changes.replaceChildren();
    for (const c of plan.changes) {
      const to = c.prefill + "P+" + c.decode + "D";
      changes.append(row([Math.round(-c.t) + " s ago", c.reason, to, c.detail]));
    }
  }
  const workers = $("workers");
  workers.replaceChildren();
  for (const w of d.workers) {
    const health = document.createElement("span");
    health.className = w.healthy ? "ok" : "down";
    health.textContent = w.health;
    const kv = document.createElement("span");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = Math.round(60 * (w.kv_usage || 0)) + "px";
    kv.append(bar, " " + pct(w.kv_usage));
    workers.append(row([w.worker, w.role, String(w.tp), health, String(w.running), String(w.waiting), kv]));
  }
}

async function poll() {
  const status = $("status");
  try {
    const headers = {};
    const key = localStorage.getItem(KEY);
    if (key) headers["Authorization"] = "Bearer " + key;
    const r = await fetch("dashboard/data", {headers: headers, cache: "no-store"});
    if (r.status === 401) {
      $("auth").classList.add("shown");
      throw new Error("API key needed");
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    $("auth").classList.remove("shown");
    status.className = "";
    status.textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.ready = "1";
  } catch (e) {
    status.className = "error";
    status.textContent = String(e.message || e);
  }
  setTimeout(poll, POLL_MS);
}

$("auth").addEventListener("submit", (e) => {
  e.preventDefault();
  localStorage.setItem(KEY, $("key").value);
  $("key").value = "";
});
poll();
</script>
</body>
</html>
"""
