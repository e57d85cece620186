"""``pdserve serve --autoscale`` on its own private Ray instance: the instance is sized for the
planner's largest layout, so the pools grow past their first size (a private instance sized for
the first workers only had no room for one more, and every growth waited out its start-up
timeout). The growth here is the planner's first check bringing the pools up to bounds whose
minimum is their maximum, so no load step is needed to reach the largest layout; the load step
and the quiet after it are ``test_fake_autoscaler``'s, on a cluster of its own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.client import free_port, wait_ready
from tests.service.helpers import stop_process
from tests.service.test_fake_autoscaler import prompt

pytestmark = pytest.mark.slow


def _workers(url: str) -> list[dict[str, object]]:
    workers: list[dict[str, object]] = httpx.get(f"{url}/cluster/status", timeout=10).json()["workers"]
    return workers


def _layout(url: str) -> tuple[int, int]:
    roles = [w["role"] for w in _workers(url)]
    return roles.count("prefill"), roles.count("decode")


def test_a_private_instance_has_room_for_the_largest_layout(tmp_path: Path) -> None:
    http = free_port()
    # started at 1P+1D (the default layout), bounded to exactly 3P+2D
    cmd = [str(Path(sys.executable).parent / "pdserve"), "serve", "--model", "tiny", "--compute",
           "emulated:h100-llama3-8b", "--no-local-prefill", "--slo", "chat:ttft=200,tpot=50", "--autoscale",
           "--min-prefill", "3", "--max-prefill", "3", "--min-decode", "2", "--max-decode", "2",
           "--autoscale-interval", "3", "--http-port", str(http),
           "--grpc-port", str(free_port())]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}"
    try:
        wait_ready(f"{url}/health", proc, timeout_s=180)
        deadline = time.monotonic() + 60
        while _layout(url) != (3, 2) or not all(w["health"] == "healthy" for w in _workers(url)):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        text = log.read_text()
        assert "planner: scale_up to 3P+2D (back within the bounds)" in text, text[-3000:]
        assert "not placed and ready" not in text
        body = {"model": "tiny", "prompt": prompt(1), "max_tokens": 8, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        workers = _workers(url)
        assert all(w["running"] == 0 and w["kv_blocks"]["free"] == w["kv_blocks"]["total"] for w in workers)  # type: ignore[index]
    finally:
        stop_process(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]
