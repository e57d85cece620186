"""A pdserve server in a subprocess for benchmark scripts (requests go through ``pdserve.bench.client``)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# Below Linux's ephemeral range (32768-60999) and above Ray's worker ports (10002-19999): a
# server is handed its port well before it binds it (after Ray and the workers start), and
# meanwhile any process binding port 0 (Ray's own listeners, the workers') could take one the
# kernel picked from the ephemeral range.
PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback TCP port free now, from ``PORTS``."""
    pick = random.SystemRandom()
    for _ in range(500):
        port = pick.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {PORTS.start}-{PORTS.stop - 1}")


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code in (200, 404, 405):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    http: str
    grpc: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_pdserve(*serve_args: str) -> Server:
    """``pdserve serve`` with free ports, once /health answers 200."""
    hp, gp = free_port(), free_port()
    exe = str(Path(sys.executable).with_name("pdserve"))
    cmd = [exe, "serve", "--http-port", str(hp), "--grpc-port", str(gp), *serve_args]
    proc = subprocess.Popen(cmd, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    try:
        wait_ready(f"http://127.0.0.1:{hp}/health", proc)
    except BaseException:
        proc.kill()
        raise
    return Server(proc, f"http://127.0.0.1:{hp}", f"127.0.0.1:{gp}")
