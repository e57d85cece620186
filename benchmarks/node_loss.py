"""Node loss: how long Ray's control plane takes to declare a dead node dead, with the node
health checks ``pdserve.deploy.ray_instance.NODE_HEALTH`` sets (``--default`` for Ray's own).

A head node and a second node (separate raylets on this host, ``ray.cluster_utils``); the
second node's raylet is SIGKILLed (what a crashed or unplugged machine looks like to the
head: no goodbye) and the time until the GCS reports the node dead is measured, with the
time until a worker actor that lived there is reported dead.

    .venv/bin/python -m benchmarks.node_loss              # about 20 seconds
    .venv/bin/python -m benchmarks.node_loss --default    # Ray's defaults, for comparison
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from benchmarks.common import emit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--default", action="store_true", help="Ray's own health-check settings")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    from pdserve.deploy.ray_instance import NODE_HEALTH

    system = {} if args.default else dict(NODE_HEALTH)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": system})
    node = cluster.add_node(num_cpus=1, resources={"victim": 1})
    ray.init(address=cluster.address, include_dashboard=False)
    try:

        @ray.remote(num_cpus=0, resources={"victim": 1})
        class Probe:
            def pid(self) -> int:
                return os.getpid()

        probe = Probe.remote()  # type: ignore[attr-defined]
        ray.get(probe.pid.remote(), timeout=60)
        node_id = node.node_id
        raylet = node.all_processes["raylet"][0].process
        t0 = time.monotonic()
        os.kill(raylet.pid, signal.SIGKILL)
        actor_dead = node_dead = None
        while time.monotonic() - t0 < args.timeout and (actor_dead is None or node_dead is None):
            if node_dead is None and any(n["NodeID"] == node_id and not n["Alive"] for n in ray.nodes()):
                node_dead = time.monotonic() - t0
            if actor_dead is None:
                try:
                    ray.get(probe.pid.remote(), timeout=0.2)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    actor_dead = time.monotonic() - t0
                except ray.exceptions.GetTimeoutError:
                    pass
            time.sleep(0.05)
        result = {
            "settings": "ray-default" if args.default else "pdserve",
            "health_checks": system,
            "node_dead_s": None if node_dead is None else round(node_dead, 2),
            "actor_dead_s": None if actor_dead is None else round(actor_dead, 2),
        }
        print(f"node dead after {result['node_dead_s']} s, its actor after {result['actor_dead_s']} s",
              file=sys.stderr)  # fmt: skip
        emit(result)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
