"""``pdserve serve`` with a tensor-parallel pool, as a user runs it (workers in the serve
process, ``--local``; their other ranks its children): the official openai client is served,
each worker's degree shows in ``/cluster/status``, and a degree the model cannot shard fails in
seconds naming the valid ones."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from benchmarks.client import free_port, wait_ready

openai = pytest.importorskip("openai")


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 1), (1, 2)])
def test_serve_with_a_tp_pool_answers_the_openai_client(ptp: int, dtp: int) -> None:
    hp = free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--local", "--model", "tiny", "--http-port", str(hp),
           "--grpc-port", str(free_port()), "--prefill-tp", str(ptp), "--decode-tp", str(dtp)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{hp}/health", proc, timeout_s=120)  # type: ignore[arg-type]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{hp}/v1", api_key="unused")
        out = client.completions.create(model="tiny", prompt="split over ranks", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
        status = httpx.get(f"http://127.0.0.1:{hp}/cluster/status").json()
        assert {w["worker_id"]: w["tp"] for w in status["workers"]} == {"prefill-0": ptp, "decode-0": dtp}
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]


def test_a_degree_the_model_cannot_shard_fails_in_seconds_naming_the_valid_ones() -> None:
    cmd = [sys.executable, "-m", "pdserve", "serve", "--local", "--model", "tiny", "--decode-tp", "8",
           "--http-port", str(free_port()), "--grpc-port", str(free_port())]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--decode-tp 8 is not valid for this model" in done.stderr
    assert "valid degrees: 1, 2, 4" in done.stderr
    assert time.monotonic() - t0 < 15
