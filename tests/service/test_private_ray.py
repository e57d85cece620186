"""Without an address, ``start_ray`` starts a private Ray instance whatever the machine says:
a RAY_ADDRESS left in the environment (or a ``ray start`` cluster's record) is not joined."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import ray
from pdserve.deploy.ray_instance import start_ray
assert start_ray(None, 1) is True
print("gcs", ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


def test_no_address_means_a_private_instance_even_with_ray_address_set() -> None:
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}  # nothing listens there
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    gcs = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("gcs "))
    assert not gcs.endswith(":1"), gcs


def _ray_token(pid: int) -> str:
    """The token the Ray processes that ``pid`` started were given (their environment)."""
    import psutil

    gcs = [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "gcs_server"]
    assert len(gcs) == 1, gcs
    return str(gcs[0].environ().get("RAY_AUTH_TOKEN", ""))


# Ray 2.60's native servers listen on every interface whatever they are told (its GCS, raylet
# and every core worker's gRPC server, the driver's inside ``pdserve serve`` included); newer
# Ray binds them to the node address. These are the processes allowed to hold such a socket.
RAY_NATIVE = ("gcs_server", "raylet", "ray::", "pdserve", "python")


def _listeners(pid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of ``pid`` and its children."""
    import psutil

    root = psutil.Process(pid)
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns, name = proc.net_connections(kind="tcp"), proc.name()
        except psutil.Error:  # a short-lived helper that has gone
            continue
        out += [(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # gRPC's IPv4 listener on a dual-stack socket
    return (mapped or address).is_loopback


def _channel_address(log: str) -> str:
    return log.split("workers connect to ", 1)[1].split()[0]


def test_two_deployments_on_one_host_keep_their_own_ray_tokens(tmp_path: object) -> None:
    """Each private instance gets a token of its own, kept in its processes' environment: a
    second ``pdserve serve`` on the host neither reads nor rewrites the first's (Ray's shared
    ``~/.ray/auth_token`` is not used), and both serve side by side. Every listener pdserve opens
    (both APIs, the worker channel, each worker's KV listener) is on loopback; the only
    wildcard listeners in the process tree are Ray's own (see ``RAY_NATIVE``)."""
    from pathlib import Path

    import httpx

    from benchmarks.client import free_port, wait_ready

    home = Path(str(tmp_path))
    (home / ".ray").mkdir()
    shared = home / ".ray" / "auth_token"
    shared.write_text("f" * 64)  # a token another tool left: must stay as it is, and unused
    env = {**os.environ, "HOME": str(home)}
    env.pop("RAY_AUTH_TOKEN", None)
    exe = str(Path(sys.executable).with_name("pdserve"))
    procs, ports, logs = [], [], []
    procs_args: dict[int, list[str]] = {}
    try:
        for i in range(2):
            hp = free_port()
            cmd = [exe, "serve", "--model", "tiny", "--http-port", str(hp), "--grpc-port", str(free_port())]
            logs.append(home / f"serve-{i}.log")
            with logs[-1].open("w") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            procs_args[procs[-1].pid] = cmd
            ports.append(hp)
        for proc, hp, log in zip(procs, ports, logs, strict=True):
            try:
                wait_ready(f"http://127.0.0.1:{hp}/health", proc, timeout_s=120)  # type: ignore[arg-type]
            except RuntimeError as e:
                raise AssertionError(f"{e}: {log.read_text()[-3000:]}") from None
        tokens = [_ray_token(p.pid) for p in procs]
        assert all(len(t) == 64 for t in tokens) and tokens[0] != tokens[1] and "f" * 64 not in tokens
        for hp in ports:
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
            r = httpx.post(f"http://127.0.0.1:{hp}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        assert shared.read_text() == "f" * 64
        for proc, hp, log in zip(procs, ports, logs, strict=True):
            listening = _listeners(proc.pid)
            status = httpx.get(f"http://127.0.0.1:{hp}/cluster/status", timeout=10).json()
            ours = {hp, int(_channel_address(log.read_text()).rsplit(":", 1)[1])}
            ours |= {int(w["address"].rsplit(":", 1)[1]) for w in status["workers"] if w["address"]}
            grpc_port = int(next(a for a in procs_args[proc.pid] if a.isdigit() and int(a) != hp))
            ours.add(grpc_port)
            found = {port: ip for ip, port, _ in listening if port in ours}
            assert set(found) == ours and all(_loopback(ip) for ip in found.values()), (found, ours)
            wildcard = [(ip, port, name) for ip, port, name in listening if ip in ("0.0.0.0", "::")]
            assert all(name.startswith(RAY_NATIVE) for _, _, name in wildcard), wildcard
            print(f"wildcard listeners (Ray's): {sorted(wildcard)}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
