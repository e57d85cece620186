"""``pdserve serve --autoscale`` on its own private Ray instance: the instance is sized for the
planner's largest layout, so a load step grows the pools past their first size (a private
instance sized for the first workers only had no room for one more, and every growth waited
out its start-up timeout), and the quiet brings them back; nothing fails, every block is free."""

from __future__ import annotations

import concurrent.futures
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


def _layout(url: str) -> tuple[int, int]:
    roles = [w["role"] for w in httpx.get(f"{url}/cluster/status", timeout=10).json()["workers"]]
    return roles.count("prefill"), roles.count("decode")


def test_a_private_instance_has_room_for_the_largest_layout(tmp_path: Path) -> None:
    http = free_port()
    cmd = [str(Path(sys.executable).parent / "pdserve"), "serve", "--model", "tiny", "--compute",
           "emulated:h100-llama3-8b", "--no-local-prefill", "--slo", "chat:ttft=200,tpot=50", "--autoscale",
           "--max-prefill", "3", "--max-decode", "2", "--autoscale-interval", "3", "--http-port", str(http),
           "--grpc-port", str(free_port())]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}"
    try:
        wait_ready(f"{url}/health", proc, timeout_s=180)
        assert _layout(url) == (1, 1)

        def one(i: int) -> int:
            body = {"model": "tiny", "prompt": prompt(i), "max_tokens": 16, "ignore_eos": True}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code

        biggest = 2
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            calls = [pool.submit(one, i) for i in range(200)]
            while not all(c.done() for c in calls):
                biggest = max(biggest, sum(_layout(url)))
                time.sleep(0.5)
            assert [c.result() for c in calls] == [200] * 200
        deadline = time.monotonic() + 60
        while biggest <= 2:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            biggest = max(biggest, sum(_layout(url)))
            time.sleep(0.5)
        assert "not placed and ready" not in log.read_text()
        deadline = time.monotonic() + 120
        while _layout(url) != (1, 1):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1.0)
        workers = httpx.get(f"{url}/cluster/status", timeout=10).json()["workers"]
        assert all(w["running"] == 0 and w["kv_blocks"]["free"] == w["kv_blocks"]["total"] for w in workers)
    finally:
        stop_process(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]
