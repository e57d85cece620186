"""Worker pools on Ray: start or join a cluster, reserve a placement group, start the actors.

Each worker is a threaded Ray actor (its long-poll ``collect`` and commands run concurrently)
pinned to one bundle of a PACK placement group: one GPU per worker on GPU nodes, CPUs
otherwise. Ray's dashboard stays off (or on loopback) and token auth stays on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import uuid
from typing import Any

from pdserve.deploy.pools import PoolSpec, host_class
from pdserve.router.workers import WorkerHandle

log = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 64


class RayCaller:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        ref = getattr(self.actor, method).remote(*args)
        fut = asyncio.wrap_future(ref.future())
        return await asyncio.wait_for(fut, timeout_s) if timeout_s else await fut

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def start_ray(address: str | None, num_cpus: int) -> bool:
    """Join ``address`` or start a private local instance sized for ``num_cpus`` logical CPUs.
    True when this call started (and so owns) the Ray instance."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": "pdserve", "log_to_driver": True}
    if address:
        ray.init(address=address, **kwargs)
        return False
    ray.init(
        num_cpus=max(num_cpus, os.cpu_count() or 1),
        include_dashboard=False,
        object_store_memory=256 << 20,
        **kwargs,
    )
    return True


def launch_ray(
    spec: PoolSpec,
    timeout_s: float = 300.0,
    progress: bool = True,
    secret: bytes | None = None,
    router_address: str = "",
) -> tuple[list[WorkerHandle], Any]:
    """Start the workers; returns their handles and the placement group (remove it to free the
    resources once the actors are gone)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    specs = spec.worker_specs(secret, router_address)
    bundle: dict[str, float] = {"CPU": spec.cpus_per_worker}
    if spec.gpus_per_worker:
        bundle["GPU"] = spec.gpus_per_worker
    deployment = uuid.uuid4().hex[:8]
    pg = placement_group([dict(bundle) for _ in specs], strategy="PACK", name=f"pdserve-{deployment}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise TimeoutError(
            f"Ray could not place {len(specs)} workers of {bundle} within {timeout_s:g}s "
            f"(cluster resources: {ray.cluster_resources()})"
        )
    actors = []
    for i, ws in enumerate(specs):
        cls = ray.remote(host_class(ws.role))
        actors.append(
            cls.options(
                name=f"pdserve-{deployment}-{ws.worker_id}",
                num_cpus=spec.cpus_per_worker,
                num_gpus=spec.gpus_per_worker,
                max_concurrency=ACTOR_CONCURRENCY,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(ws)
        )
    pending = {a.info.remote(): a for a in actors}
    infos: dict[Any, Any] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise TimeoutError(f"{len(pending)} workers not ready after {timeout_s:g}s")
        actor = pending.pop(done[0])
        infos[actor] = ray.get(done[0])  # raises the worker's start-up error, if any
        if progress:
            print(f"  worker {infos[actor].worker_id} ready ({len(infos)}/{len(actors)})", file=sys.stderr)
    return [WorkerHandle(infos[a], RayCaller(a)) for a in actors], pg


def release(pg: Any, shutdown: bool) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(pg)
    if shutdown:
        ray.shutdown()
