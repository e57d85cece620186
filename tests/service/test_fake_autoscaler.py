"""``pdserve serve --autoscale`` on a Ray cluster whose autoscaler adds and removes nodes: Ray's
fake multi-node provider, whose "nodes" are raylets started on this machine by the autoscaler
(v1, with a configuration written here: the wheel ships no example). A load step makes the
planner grow the pools and Ray add nodes for the new workers; the quiet after it makes the
planner retire them and Ray remove the idle nodes. No request fails and every block is free.
The cluster has fewer nodes than the planner may ask for: a worker Ray cannot place is given up
after a bounded wait instead of holding the planner until the start-up timeout.

Kept to itself: its own HOME, auth token and GCS port; it never runs ``ray stop`` (which stops
every Ray on the machine) but kills the processes that carry its token, and it puts back the
record of the machine's "current" cluster that ``ray start --head`` overwrites.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.client import free_port, wait_ready
from tests.service.helpers import kill_token_holders, stop_process, token_holders

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
HEAD_ID = "f" * 51 + "00000"  # the fake provider's id for the head node
CURRENT = Path("/tmp/ray/ray_current_cluster")  # ``ray start --head`` records itself here
# Fewer nodes than the load step makes the planner ask for (it asks for 4-5 workers): a worker
# the cluster cannot place must not stop the planner (its start is cancelled after a bounded
# wait, and the pools still shrink in the quiet).
WORKER_NODES_MAX = 3

CONFIG = """\
cluster_name: pdserve-fake
max_workers: {max_workers}
upscaling_speed: 1.0
idle_timeout_minutes: 0.1
provider:
  type: fake_multinode
  gcs_address: 127.0.0.1:{port}
  use_node_id_as_ip: true
  disable_launch_config_check: true
  disable_node_updaters: true
auth:
  ssh_user: ray
available_node_types:
  ray.head.default:
    resources: {{}}
    node_config: {{}}
    max_workers: 0
  cpu_worker:
    resources: {{CPU: 1}}
    node_config: {{}}
    min_workers: 0
    max_workers: {max_workers}
head_node_type: ray.head.default
file_mounts: {{}}
cluster_synced_files: []
file_mounts_sync_continuously: false
initialization_commands: []
setup_commands: []
head_setup_commands: []
worker_setup_commands: []
head_start_ray_commands: []
worker_start_ray_commands: []
"""


class Cluster:
    def __init__(self, url: str, env: dict[str, str], log: Path) -> None:
        self.url, self.env, self.log = url, env, log

    def worker_nodes(self) -> int:
        """Worker nodes running: the fake provider's nodes are raylets on this machine, started
        (and killed) by the autoscaler with this cluster's token, each with a node id of its own.
        Counted from the process table: ``ray status`` would cost two seconds of CPU a look, and
        looked at every second it takes a core from the cluster under test."""
        return sum(
            p.info["name"] == "raylet" and env.get("RAY_OVERRIDE_NODE_ID_FOR_TESTING") != HEAD_ID
            for p, env in token_holders(self.env["RAY_AUTH_TOKEN"])
        )

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = httpx.get(f"{self.url}/cluster/status", timeout=10).json()
        return result

    def layout(self) -> tuple[int, int]:
        roles = [w["role"] for w in self.status()["workers"]]
        return roles.count("prefill"), roles.count("decode")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("fake-autoscaler")
    (root / "home").mkdir()
    token, port = secrets.token_hex(32), free_port()
    cfg = root / "autoscaler.yaml"
    cfg.write_text(CONFIG.format(port=port, max_workers=WORKER_NODES_MAX))
    env = {**os.environ, "HOME": str(root / "home"), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    # the autoscaler looks every second (5 s by default): each of the test's four scaling events
    # would otherwise wait up to that long before a node is asked for or removed
    head_env = {**env, "RAY_FAKE_CLUSTER": "1", "RAY_OVERRIDE_NODE_ID_FOR_TESTING": HEAD_ID,
                "RAY_enable_autoscaler_v2": "0", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}  # fmt: skip
    current = CURRENT.read_text() if CURRENT.exists() else None
    head = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
            "--num-cpus=0", f"--autoscaling-config={cfg}", "--disable-usage-stats",
            "--include-dashboard=false"]  # fmt: skip
    log = root / "serve.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        started = subprocess.run(head, env=head_env, capture_output=True, text=True, timeout=120, check=False)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        http = free_port()
        # No CPU on the head: each worker's placement group needs a node the autoscaler adds.
        cmd = [str(BIN / "pdserve"), "serve", f"--address=127.0.0.1:{port}", "--model", "tiny",
               "--compute", "emulated:h100-llama3-8b", "--no-local-prefill", "--slo", "chat:ttft=200,tpot=50",
               "--autoscale", "--min-prefill", "1", "--max-prefill", "3", "--min-decode", "1",
               "--max-decode", "2", "--autoscale-interval", "3", "--autoscale-start-wait", "12",
               "--http-port", str(http), "--grpc-port", str(free_port())]  # fmt: skip
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{http}"
        try:
            wait_ready(f"{url}/health", proc, timeout_s=180)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}: {log.read_text()[-4000:]}") from None
        yield Cluster(url, env, log)
    finally:
        if proc is not None:
            stop_process(proc)
        kill_token_holders(token)
        if current is not None:
            with contextlib.suppress(OSError):
                CURRENT.write_text(current)


def prompt(k: int) -> list[int]:
    """3,000 tokens (about 80 ms of emulated H100 prefill), no prefix shared with another one."""
    return [k % 200 + 20, *((7 * i + k) % 200 + 20 for i in range(2999))]


def _wait(what: str, ok: Any, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"{what}: {log.read_text()[-3000:]}"
        time.sleep(1.0)


def test_a_load_step_adds_nodes_and_the_quiet_removes_them(cluster: Cluster) -> None:
    assert cluster.layout() == (1, 1)
    _wait("the first two workers' nodes", lambda: cluster.worker_nodes() == 2, 60, cluster.log)

    def one(i: int) -> int:
        body = {"model": "tiny", "prompt": prompt(i), "max_tokens": 16, "ignore_eos": True}
        return httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120).status_code

    most_nodes, biggest = 2, (1, 1)
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        calls = [pool.submit(one, i) for i in range(200)]
        while not all(c.done() for c in calls):
            most_nodes = max(most_nodes, cluster.worker_nodes())
            biggest = max(biggest, cluster.layout(), key=sum)
            time.sleep(1.0)
        codes = [c.result() for c in calls]
    assert codes == [200] * 200
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'reason="overloaded"' in metrics or 'reason="scale_up"' in metrics, metrics[-2000:]
    _wait("the grown pools", lambda: sum(cluster.layout()) > 2, 60, cluster.log)
    biggest = max(biggest, cluster.layout(), key=sum)
    _wait("nodes for the new workers", lambda: cluster.worker_nodes() >= sum(biggest), 60, cluster.log)
    most_nodes = max(most_nodes, cluster.worker_nodes())
    assert most_nodes > 2 and sum(biggest) > 2, (most_nodes, biggest)
    assert most_nodes <= WORKER_NODES_MAX

    # The quiet: the planner retires workers down to its minimum, Ray removes the idle nodes.
    _wait("back to 1P+1D", lambda: cluster.layout() == (1, 1), 120, cluster.log)
    _wait("idle nodes removed", lambda: cluster.worker_nodes() == 2, 90, cluster.log)
    assert 'reason="scale_down"' in httpx.get(f"{cluster.url}/metrics", timeout=10).text
    workers = cluster.status()["workers"]
    assert all(w["running"] == 0 and w["kv_blocks"]["free"] == w["kv_blocks"]["total"] for w in workers)
    log = cluster.log.read_text()
    assert "Traceback" not in log
    # "planner: overloaded to 3P+2D (...)": the largest layout the planner asked for
    asked = [
        int(p) + int(d)
        for p, d in re.findall(r"planner: (?:overloaded|scale_up|switch) to (\d+)P\+(\d+)D", log)
    ]
    assert max(asked, default=0) > WORKER_NODES_MAX, asked  # more than the cluster holds ...
    assert "not placed and ready within" in log, log[-3000:]  # ... so the surplus start was given up
