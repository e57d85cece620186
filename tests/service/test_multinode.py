"""pdserve across Ray nodes with distinct addresses: four network namespaces (the head with the
router, and three one-CPU nodes for one prefill and two decode workers) joined by a bridge,
addresses from the benchmarking range 198.18.0.0/15 on links the test creates and always
removes. No ``--kv-host``: every worker advertises its own node's address, and KV crosses between
the nodes over tcp; with ``--internal-tls``, as a deployment whose links leave one host runs.

Where namespaces cannot be made (no root, no iproute2, a kernel or container that refuses them)
the nodes are loopback addresses instead (127.0.0.2-5, which Linux routes to ``lo`` with no
set-up), the reason is printed, and the deployment runs with ``--transport tcp``: the nodes then
share one host, where ``auto`` would rightly pick shm. ``PDSERVE_TEST_LOOPBACK_NODES=1`` forces
that mode (to test it)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.helpers import MODEL, hf_reference, stop_process

pytestmark = pytest.mark.slow

NET = "198.18.7"
BRIDGE = "pdmnbr0"
# The head (Ray's GCS and the router), then three one-CPU nodes: each worker on a node of its own.
NAMESPACES = {"pdmn0": f"{NET}.1", "pdmn1": f"{NET}.2", "pdmn2": f"{NET}.3", "pdmn3": f"{NET}.4"}
LOOPBACK = {"pdmn0": "127.0.0.2", "pdmn1": "127.0.0.3", "pdmn2": "127.0.0.4", "pdmn3": "127.0.0.5"}
NODES = dict(NAMESPACES)  # node name -> its address, in the mode ``nodes()`` chose
BIN = Path(sys.executable).parent


class Mode:
    namespaces = True  # False: loopback addresses on this host's own network


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=20)


def _node_pids(node: str) -> list[int]:
    """Processes on ``node``: in its namespace, or (loopback mode) those started for its address."""
    import psutil

    if Mode.namespaces:
        out = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, check=False)
        return [int(p) for p in out.stdout.split()]
    # The node's raylet and agents name its address on their command lines; its workers (whose
    # command line becomes "ray::...") are their children.
    address, pids = LOOPBACK[node], set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or ()) + " "
        if f"={address} " in cmdline:
            pids.add(p.info["pid"])
            with contextlib.suppress(psutil.Error):
                pids.update(c.pid for c in p.children(recursive=True))
    return sorted(pids)


def _teardown() -> None:
    """Kill every process on the nodes, then remove the links and the namespaces (a veth
    outlives its namespace while processes are still in it, so both ends are removed by name)."""
    import psutil

    victims = []
    for node in NAMESPACES:
        for pid in _node_pids(node):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                p.kill()
                victims.append(p)
    psutil.wait_procs(victims, timeout=10)
    if Mode.namespaces:
        for i, ns in enumerate(NAMESPACES):
            _ip("link", "del", f"pdmnv{i}", check=False)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", BRIDGE, check=False)


def _namespaces_unavailable() -> str:
    """Why network namespaces cannot be used here ("" when they can)."""
    if os.environ.get("PDSERVE_TEST_LOOPBACK_NODES") == "1":
        return "PDSERVE_TEST_LOOPBACK_NODES=1"
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = subprocess.run(["ip", "netns", "add", "pdmnprobe"], capture_output=True, text=True, check=False)
    subprocess.run(["ip", "netns", "del", "pdmnprobe"], capture_output=True, check=False)
    return "" if probe.returncode == 0 else f"ip netns add failed: {probe.stderr.strip()}"


@contextlib.contextmanager
def nodes() -> Iterator[None]:
    why = _namespaces_unavailable()
    Mode.namespaces = not why
    NODES.clear()
    NODES.update(NAMESPACES if Mode.namespaces else LOOPBACK)
    if not Mode.namespaces:
        print(f"\nmulti-node test on loopback addresses, not network namespaces: {why}", flush=True)
        _teardown()
        try:
            yield
        finally:
            _teardown()
        return
    _teardown()  # what an interrupted run may have left
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{NET}.254/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for i, (ns, address) in enumerate(NAMESPACES.items()):
            _ip("netns", "add", ns)
            _ip("link", "add", f"pdmnv{i}", "type", "veth", "peer", "name", f"pdmnp{i}")
            _ip("link", "set", f"pdmnv{i}", "master", BRIDGE)
            _ip("link", "set", f"pdmnv{i}", "up")
            _ip("link", "set", f"pdmnp{i}", "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", f"pdmnp{i}")
            _ip("-n", ns, "link", "set", f"pdmnp{i}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        _teardown()


def _in(ns: str, *cmd: str, env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
    prefix = ["ip", "netns", "exec", ns] if Mode.namespaces else []
    return subprocess.Popen([*prefix, *cmd], env=env, text=True, **kw)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    log = tmp_path_factory.mktemp("multinode") / "serve.log"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "PATH": f"{BIN}:{os.environ['PATH']}"}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    ray = str(BIN / "ray")
    common = ["--disable-usage-stats", "--include-dashboard=false"]
    with nodes():
        head = NODES["pdmn0"]
        head_start = [ray, "start", "--head", f"--node-ip-address={head}", "--port=6379", "--num-cpus=0"]
        starts = [("pdmn0", [*head_start, *common])]
        for ns in ("pdmn1", "pdmn2", "pdmn3"):
            starts.append((ns, [ray, "start", f"--address={head}:6379", f"--node-ip-address={NODES[ns]}",
                                "--num-cpus=1", "--disable-usage-stats"]))  # fmt: skip
        for ns, cmd in starts:
            p = _in(ns, *cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out[-3000:]
        cmd = [str(BIN / "pdserve"), "serve", f"--address={head}:6379", f"--host={head}", "--model", MODEL,
               "--prefill", "1", "--decode", "2", "--http-port", "8000", "--grpc-port", "50051",
               "--internal-tls"]  # fmt: skip
        if not Mode.namespaces:
            cmd += ["--transport", "tcp"]  # one host: auto would pick shm (see the module docstring)
        with log.open("w") as out:
            proc = _in("pdmn0", *cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://{head}:8000"
        try:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, log.read_text()[-4000:]
                with contextlib.suppress(httpx.HTTPError):
                    up = httpx.get(f"{url}/health", timeout=2).status_code == 200
                    if up and "internal     TLS (deployment CA)" in log.read_text():
                        break
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.5)
            yield url, proc
        finally:
            stop_process(proc)


def _status(url: str) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(f"{url}/cluster/status", timeout=10).json()
    return result


def _decode_nodes(url: str) -> dict[str, str]:
    """Decode worker id -> the address of its node (from the KV address it advertises)."""
    return {
        w["worker_id"]: w["address"].rpartition(":")[0]
        for w in _status(url)["workers"]
        if w["role"] == "decode"
    }


def test_workers_advertise_their_own_nodes(cluster: tuple[str, subprocess.Popen[str]]) -> None:
    url, _ = cluster
    nodes = _decode_nodes(url)
    # Each decode worker's KV address is its own node's: not loopback, not the head's, not shared.
    assert len(nodes) == 2 and len(set(nodes.values())) == 2, nodes
    assert set(nodes.values()) <= {NODES["pdmn1"], NODES["pdmn2"], NODES["pdmn3"]}, nodes
    assert NODES["pdmn0"] not in nodes.values()


def test_greedy_requests_across_nodes_equal_hf_and_move_kv_between_nodes(
    cluster: tuple[str, subprocess.Popen[str]],
) -> None:
    url, _ = cluster
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(8)]

    def one(prompt: list[int]) -> list[int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        ids: list[int] = r.json()["choices"][0]["token_ids"]
        return ids

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, prompts))
    for prompt, ids in zip(prompts, results, strict=True):
        assert ids == hf_reference(prompt, 12)

    # Every decode worker is on a node of its own, away from the prefill worker's: the workers'
    # own counters say everything they received came over tcp (auto picks shm only for a peer
    # on the same host), and so does everything the prefill worker sent. (Each side's counters
    # reach the router with its next load report: up to a heartbeat apart.)
    def moved() -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("pdserve:kv_transfer_bytes_total{"):
                labels, value = line.rsplit(" ", 1)
                role = labels.split('role="', 1)[1].split('"', 1)[0]
                backend = labels.split('backend="', 1)[1].split('"', 1)[0]
                out[role, backend] = out.get((role, backend), 0.0) + float(value)
        return out

    deadline = time.monotonic() + 5
    while (m := moved()).get(("decode", "tcp")) != m.get(("prefill", "tcp")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {k for k, v in m.items() if v > 0} == {("decode", "tcp"), ("prefill", "tcp")}, m
    assert ("prefill", "shm") in m  # the backends a worker could use are counted from 0
    assert m["decode", "tcp"] == m["prefill", "tcp"] > 0, m


def _worker_pid(node: str) -> int:
    import psutil

    workers = [p for p in _node_pids(node) if psutil.Process(p).name() == "ray::PoolWorker"]
    assert len(workers) == 1, workers
    return workers[0]


def test_sigkill_of_the_remote_decode_worker(cluster: tuple[str, subprocess.Popen[str]]) -> None:
    """A decode worker on another node is killed mid-stream: its stream moves to the other decode
    worker (a third node) and ends with every token, none twice; a replacement joins on the node
    the killed one freed."""
    import json

    url, _ = cluster
    tokens = 1500
    body = {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    before = _decode_nodes(url)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = [json.loads(next(x for x in lines if x.startswith("data: {"))[6:])]
        running = [w["worker_id"] for w in _status(url)["workers"] if w["role"] == "decode" and w["running"]]
        assert len(running) == 1, running  # the worker that holds the stream
        victim = running[0]
        node = next(n for n, address in NODES.items() if address == before[victim])
        os.kill(_worker_pid(node), signal.SIGKILL)
        t0 = time.monotonic()
        events += [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    took = time.monotonic() - t0
    assert not [e["error"] for e in events if "error" in e]
    got = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids", [])]
    assert got == hf_reference(list(range(3, 40)), tokens), "every token once, as HF's"
    assert took < 90, took
    deadline = time.monotonic() + 60
    while not (fresh := {w: a for w, a in _decode_nodes(url).items() if w not in before}):
        assert time.monotonic() < deadline, "no replacement decode worker joined"
        time.sleep(0.5)
    assert list(fresh.values()) == [before[victim]], (before, fresh)  # on the node the killed one freed
