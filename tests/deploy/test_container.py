"""The container image's recipe and entry point. No image is built here (no registry for base
images), so the Dockerfile is checked as text and its entry-point script is run as the image runs
it: serving, answering its health check, draining on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from benchmarks.client import free_port, wait_ready

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"


def _instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_dockerfile_recipe() -> None:
    steps = _instructions()
    args = dict(a.split("=", 1) for op, a in steps if op == "ARG" and "=" in a)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", args["BASE_IMAGE"]), "a pinned base image"
    assert {"VARIANT", "TORCH_INDEX", "TORCH_VERSION"} <= set(args), "CPU and CUDA builds"
    assert args["TORCH_INDEX"].endswith("/cpu")
    runs = " && ".join(a for op, a in steps if op == "RUN")
    for spec in re.findall(r"pip install ([^&]+)", runs):
        for token in spec.split():
            if token.startswith("-") or token.startswith("/src") or token.startswith("http"):
                continue
            assert "==" in token or "${" in token, f"unpinned pip install: {token}"
    assert all(v and v != "latest" for k, v in args.items() if k.endswith(("VERSION", "WHEEL")))
    assert re.search(r'apt-get install [^&]*"tini=\$\{TINI_VERSION\}"', runs)
    users = [a for op, a in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "runs as a non-root user"
    health = [a for op, a in steps if op == "HEALTHCHECK"]
    assert health and "pdserve-entrypoint" in health[0] and "health" in health[0]
    [entry] = [a for op, a in steps if op == "ENTRYPOINT"]
    assert entry.startswith('["/usr/bin/tini", "--"') and "pdserve-entrypoint" in entry


def _health(env: dict[str, str]) -> int:
    return subprocess.run([str(DOCKER / "entrypoint.sh"), "health"], env=env, capture_output=True,
                          timeout=30, check=False).returncode  # fmt: skip


def test_entrypoint_serves_answers_health_and_drains_on_sigterm() -> None:
    hp, gp = free_port(), free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PDSERVE_MODEL": "tiny", "PDSERVE_HOST": "127.0.0.1", "PDSERVE_HTTP_PORT": str(hp),
           "PDSERVE_API_KEY": "k"}  # fmt: skip
    assert _health(env) == 1  # nothing listens yet
    cmd = [str(DOCKER / "entrypoint.sh"), "--grpc-port", str(gp), "--local"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{hp}/health", proc, timeout_s=120)  # type: ignore[arg-type]
        assert _health(env) == 0
        r = httpx.post(f"http://127.0.0.1:{hp}/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)  # exec: pdserve itself receives it
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "model 'tiny'" in out and "draining" in out and "pdserve: stopped" in out
        assert _health(env) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
