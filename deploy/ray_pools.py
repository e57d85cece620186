"""Worker pools on Ray: start or join a cluster, place and start each worker, remove it.

Each worker is a threaded Ray actor (its process-level calls run concurrently) in a placement
group of its own, one bundle: one GPU on GPU nodes, CPUs otherwise. Workers come and go one
at a time (a lost worker's replacement, a pool that grows), and Ray's autoscaler can add or
remove a node for one worker. Removing a worker removes its placement group with it.

A private instance (``start_ray`` without an address) keeps its dashboard off and token auth
on, and tunes the control plane's node health checks (``NODE_HEALTH``) so that a dead node is
declared dead within seconds, not Ray's default half minute; clusters started with
``ray start`` get the same through ``RAY_health_check_*`` variables (``deploy/README.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.deploy.pools import PoolSpec, worker_class
from pdserve.deploy.ray_token import check_cluster_token
from pdserve.router.workers import WorkerHandle
from pdserve.worker.spec import WorkerSpec

log = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 64
# The GCS pings every raylet each period; a node that misses `threshold` pings in a row (each
# given `timeout`) is dead: about initial delay + period * threshold after it stopped.
NODE_HEALTH = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


class RayCaller:
    """Process-level calls to one worker actor; ``kill`` ends the actor and frees its placement."""

    def __init__(self, actor: Any, placement: Any = None) -> None:
        self.actor = actor
        self.placement = placement

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        ref = getattr(self.actor, method).remote(*args)
        fut = asyncio.wrap_future(ref.future())
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


def start_ray(address: str | None, num_cpus: int) -> bool:
    """Join ``address`` or start a private local instance sized for ``num_cpus`` logical CPUs.
    True when this call started (and so owns) the Ray instance."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": "pdserve", "log_to_driver": True}
    if address:
        check_cluster_token(address)  # a refused token now, in words, not after 20 s of retries
        ray.init(address=address, **kwargs)
        return False
    # A token of its own for every private instance, in the environment its processes inherit:
    # never Ray's shared ~/.ray/auth_token, which another deployment on this host would read or
    # rewrite.
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    try:  # Ray's native side reads both once per process; a second private instance re-reads
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError) as e:  # a Ray without token auth: nothing cached
        log.debug("Ray token auth not reloaded: %s", e)
    for attempt in (1, 2):
        try:
            ray.init(
                # "local": a new private instance, always; never whatever RAY_ADDRESS or the last
                # `ray start` on this machine points at.
                address="local",
                num_cpus=max(num_cpus, os.cpu_count() or 1),
                include_dashboard=False,
                object_store_memory=256 << 20,
                _system_config=dict(NODE_HEALTH),
                **kwargs,
            )
            return True
        except Exception as e:
            # Ray picks its ports by probing for free ones, so two instances starting at once on
            # one host can pick the same; the second try picks again.
            ray.shutdown()
            if attempt == 2:
                raise
            log.warning("the private Ray instance did not start (%s); trying once more", e)
    raise AssertionError("unreachable")


def keep_python_signal_handlers() -> None:
    """Ray's native runtime installs its own SIGINT/SIGTERM handlers when it starts in a process
    (they abort it); put back the process's Python-level ones, which an event loop's draining
    shutdown relies on. Only the main thread can (elsewhere this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)


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
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}


def _place(ws: WorkerSpec, where: Placement) -> tuple[Any, Any]:
    """Ask for the worker's placement group and start its actor there (both asynchronously)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    name = f"pdserve-{where.deployment}-{ws.worker_id}"
    pg = placement_group([where.bundle], strategy="STRICT_PACK", name=name)
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
            num_cpus=where.cpus,
            num_gpus=where.gpus,
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
        pending = {actor.info.remote(): i for i, (actor, _) in enumerate(placed)}
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


def shutdown_ray(grace_s: float = 2.0) -> None:
    """Stop the private Ray instance this process started, and then any of its processes that
    outlive it: Ray's agents linger for a minute when the instance stops while they start (a
    Ctrl-C during start-up)."""
    import psutil
    import ray

    def ray_processes() -> list[psutil.Process]:
        found = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "ray" in " ".join(p.cmdline()):
                    found.append(p)
        return found

    started = ray_processes()
    ray.shutdown()
    _, alive = psutil.wait_procs(started, timeout=grace_s)
    for p in alive:
        log.warning("killing Ray process %d (%s), still running after the shutdown", p.pid, p.name())
        with contextlib.suppress(psutil.Error):
            p.kill()


def request_capacity(spec: PoolSpec, workers: int) -> None:
    """Ask Ray's autoscaler for room for ``workers`` workers of ``spec`` now, ahead of the
    placement groups that will need it (a standing request: the latest replaces the last; a
    cluster without an autoscaler ignores it)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[Placement.of(spec).bundle] * max(0, workers))
