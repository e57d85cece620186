"""Worker pools on Ray: start or join a cluster, place and start each worker, remove it.

Each worker is a threaded Ray actor (its process-level calls run concurrently) in a placement
group of its own, one bundle: one GPU on GPU nodes, CPUs otherwise. Workers come and go one
at a time (a lost worker's replacement, a pool that grows), and Ray's autoscaler can add or
remove a node for one worker. Removing a worker removes its placement group with it.

Starting, joining and stopping the Ray instance itself: ``pdserve.deploy.ray_instance``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.deploy.pools import PoolSpec, worker_class
from pdserve.router.workers import WorkerHandle
from pdserve.worker.control import Control, GetInfo
from pdserve.worker.spec import WorkerSpec

log = logging.getLogger(__name__)

T = TypeVar("T")

ACTOR_CONCURRENCY = 64


class RayCaller:
    """Control messages to one worker actor, through its one ``control`` method (Ray pickles the
    message between the processes it runs); ``kill`` ends the actor and frees its placement."""

    def __init__(self, actor: Any, placement: Any = None) -> None:
        self.actor = actor
        self.placement = placement

    async def control(self, msg: Control[T], timeout_s: float | None = None) -> T:
        fut: asyncio.Future[T] = asyncio.wrap_future(self.actor.control.remote(msg).future())
        return await asyncio.wait_for(fut, timeout_s) if timeout_s else await fut

    def kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.kill(self.actor, no_restart=True)
        finally:
            if self.placement is not None:
                remove_placement_group(self.placement)
                self.placement = None


@dataclass(frozen=True)
class Placement:
    """What each worker of a deployment takes from the cluster."""

    cpus: int
    gpus: int = 0
    deployment: str = ""  # names the actors and groups: pdserve-<deployment>-<worker id>

    @classmethod
    def of(cls, spec: PoolSpec) -> Placement:
        return cls(spec.cpus_per_worker, spec.gpus_per_worker, uuid.uuid4().hex[:8])

    @property
    def bundle(self) -> dict[str, float]:
        return self.bundle_of(1)

    def bundle_of(self, tp: int) -> dict[str, float]:
        """A worker of degree ``tp``: one bundle holding all its ranks' CPUs and GPUs, so the
        group places them on one node (rank 0's actor takes it; its ranks are its children,
        rank ``r`` on the ``r``-th GPU the actor sees)."""
        return {"CPU": self.cpus * tp, **({"GPU": self.gpus * tp} if self.gpus else {})}


def _place(ws: WorkerSpec, where: Placement) -> tuple[Any, Any]:
    """Ask for the worker's placement group and start its actor there (both asynchronously)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    name = f"pdserve-{where.deployment}-{ws.worker_id}"
    pg = placement_group([where.bundle_of(ws.engine.tp)], strategy="STRICT_PACK", name=name)
    try:
        actor = _start_actor(ws, where, name, pg)
    except BaseException:
        remove_placement_group(pg)
        raise
    return actor, pg


def _start_actor(ws: WorkerSpec, where: Placement, name: str, pg: Any) -> Any:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return (
        ray.remote(worker_class())
        .options(
            name=name,
            num_cpus=where.cpus * ws.engine.tp,
            num_gpus=where.gpus * ws.engine.tp,
            max_concurrency=ACTOR_CONCURRENCY,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        )
        .remote(ws)
    )


class LaunchCancelled(RuntimeError):
    """The caller gave up on a launch (``cancel`` set); what it started was stopped."""


def _wait(refs: list[Any], num: int, deadline: float, cancel: threading.Event | None) -> list[Any]:
    """``ray.wait`` for ``num`` of ``refs`` until ``deadline``, in short slices so that ``cancel``
    ends it within half a second (a worker Ray cannot place must not hold its caller)."""
    import ray

    while True:
        left = deadline - time.monotonic()
        ready, _ = ray.wait(refs, num_returns=num, timeout=max(0.0, min(0.5, left)))
        if len(ready) >= num or left <= 0.5:
            return list(ready)
        if cancel is not None and cancel.is_set():
            raise LaunchCancelled("the launch was cancelled")


def launch_workers(
    specs: list[WorkerSpec],
    where: Placement,
    timeout_s: float = 300.0,
    progress: bool = True,
    cancel: threading.Event | None = None,
) -> list[WorkerHandle]:
    """Start the workers and wait until every one is ready (or raise, leaving none behind);
    setting ``cancel`` stops the wait (``LaunchCancelled``) and the workers with it."""
    import ray

    placed: list[tuple[Any, Any]] = []
    try:
        for ws in specs:
            placed.append(_place(ws, where))
    except BaseException:  # stop the ones already asked for
        for actor, pg in placed:
            RayCaller(actor, pg).kill()
        raise
    callers = [RayCaller(actor, pg) for actor, pg in placed]
    try:
        deadline = time.monotonic() + timeout_s
        ready = _wait([pg.ready() for _, pg in placed], len(placed), deadline, cancel)
        if len(ready) < len(placed):
            raise TimeoutError(
                f"Ray could not place {len(placed) - len(ready)} of {len(placed)} workers of "
                f"{where.bundle} within {timeout_s:g}s (cluster resources: {ray.cluster_resources()})"
            )
        pending = {actor.control.remote(GetInfo()): i for i, (actor, _) in enumerate(placed)}
        infos: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            done = _wait(list(pending), 1, deadline, cancel)
            if not done:
                raise TimeoutError(f"{len(pending)} workers not ready after {timeout_s:g}s")
            i = pending.pop(done[0])
            infos[i] = ray.get(done[0])  # raises the worker's start-up error, if any
            if progress:
                print(f"  worker {infos[i].worker_id} ready ({len(infos)}/{len(placed)})", file=sys.stderr)
    except BaseException:
        for c in callers:
            try:
                c.kill()
            except Exception as e:  # best effort: the launch failed anyway
                log.debug("cleaning up a failed launch: %s", e)
        raise
    return [WorkerHandle(infos[i], callers[i]) for i in range(len(placed))]


def request_capacity(spec: PoolSpec, workers: int) -> None:
    """Ask Ray's autoscaler for room for ``workers`` workers of ``spec`` now, ahead of the
    placement groups that will need it (a standing request: the latest replaces the last; a
    cluster without an autoscaler ignores it)."""
    from ray.autoscaler.sdk import request_resources

    widest = max(spec.tp_of(role) for role, _ in spec.roles)
    request_resources(bundles=[Placement.of(spec).bundle_of(widest)] * max(0, workers))
