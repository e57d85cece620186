"""Benchmark client pieces: a pdserve server in a subprocess, and timed streaming requests."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve.v1 import inference_pb2 as pb


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


@dataclass
class Timed:
    """One streamed request as the client saw it (seconds, perf_counter clock)."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def tpot(self) -> float:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


async def grpc_timed(stub: Any, prompt: list[int], max_tokens: int) -> Timed:
    """Stream one greedy request; every token gets the arrival time of the message carrying it."""
    req = pb.GenerateRequest(stream=True)
    req.token_ids.ids.extend(prompt)
    req.sampling.max_tokens = max_tokens
    req.sampling.temperature = 0.0
    req.sampling.ignore_eos = True
    out = Timed(time.perf_counter())
    try:
        async for msg in stub.Generate(req):
            now = time.perf_counter()
            out.token_times.extend([now] * len(msg.chunk.token_ids))
    except Exception as e:  # a failed request counts against attainment, it does not stop the run
        out.error = str(e)
    return out
