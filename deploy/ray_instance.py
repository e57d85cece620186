"""The Ray instance a deployment runs on: join a cluster or start a private one, watch that its
control plane (GCS, raylet) lives, and stop it in order.

A private instance (``start_ray`` without an address) keeps its dashboard off and token auth
on, and tunes the control plane's node health checks (``NODE_HEALTH``) so that a dead node is
declared dead within seconds, not Ray's default half minute; clusters started with
``ray start`` get the same through ``RAY_health_check_*`` variables (``deploy/README.md``).

Its processes (GCS, raylet, monitors, agents) run each in a process group of its own, so a
signal meant for ``pdserve serve``'s group (``kill -TERM -- -PGID``, a supervisor that signals
the group) reaches pdserve alone, which drains and then stops Ray; they still die with pdserve
if it is killed (Ray's own fate sharing), and its worker processes were in groups of their own
already. A supervisor that signals every process of a control group (systemd's default
``KillMode=control-group``) still stops the GCS and raylet under pdserve: ``RayWatch``
notices within seconds, so pdserve stops at once and says why, rather than hang until Ray's
core gives up on the GCS a minute later (``deploy/systemd/`` has a unit with
``KillMode=mixed``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pdserve.deploy.ray_token import check_cluster_token

log = logging.getLogger(__name__)

# The GCS pings every raylet each period; a node that misses `threshold` pings in a row (each
# given `timeout`) is dead: about initial delay + period * threshold after it stopped.
NODE_HEALTH = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
CHECK_S = 1.0  # how often ``RayWatch`` looks
MISSES = 2  # looks in a row that find a process gone before it is


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
        # Present at run time in Ray builds with token auth, absent from the stub Ray ships.
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError) as e:  # a Ray without token auth: nothing cached
        log.debug("Ray token auth not reloaded: %s", e)
    for attempt in (1, 2):
        try:
            with own_process_groups():
                ray.init(
                    # "local": a new private instance, always; never whatever RAY_ADDRESS or the
                    # last `ray start` on this machine points at.
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


@contextlib.contextmanager
def own_process_groups() -> Iterator[None]:
    """While it lasts, every process Ray's Python side starts (the head's GCS, raylet, monitors
    and agents) begins in a process group of its own. Ray keeps its own start-up hook
    (``preexec_fn``: fate sharing, SIGINT blocked); a Ray whose launcher moved runs as before,
    with a warning."""
    # Ray's private launcher module, patched by name: what it holds differs between Ray versions.
    services: Any
    try:
        services = importlib.import_module("ray._private.services")
    except ImportError:  # pragma: no cover - a Ray without it
        services = None
    popen = getattr(services, "ConsolePopen", None)
    if popen is None:
        log.warning("Ray's process launcher was not found: its processes share pdserve's process group")
        yield
        return

    class OwnGroup(popen):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            inner: Callable[[], None] | None = kwargs.get("preexec_fn")

            def preexec() -> None:
                os.setpgid(0, 0)
                if inner is not None:
                    inner()

            if sys.platform != "win32":
                kwargs["preexec_fn"] = preexec
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroup
    try:
        yield
    finally:
        services.ConsolePopen = popen


def control_plane() -> dict[str, str]:
    """``host:port`` of the Ray processes this one cannot work without: the cluster's GCS and
    this node's raylet (empty before ``start_ray``; the raylet left out where this Ray does not
    say where it listens)."""
    import ray

    if not ray.is_initialized():
        return {}
    found = {"GCS": str(ray.get_runtime_context().gcs_address)}
    node = getattr(getattr(ray._private.worker, "global_worker", None), "node", None)
    host, port = getattr(node, "node_ip_address", None), getattr(node, "node_manager_port", None)
    if host and port:
        found["raylet"] = f"{host}:{port}"
    return found


def reachable(address: str, timeout_s: float = 1.0) -> bool:
    """Whether ``address`` (``host:port``) accepts a TCP connection (a dead process's port
    refuses at once)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class RayWatch:
    """A thread that looks at each of ``processes`` (what -> ``host:port``: ``control_plane``)
    every ``every_s`` and, after ``MISSES`` looks in a row that find one gone, calls
    ``on_gone`` with why, once (from its own thread). A thread of its own, with blocking
    sockets: an event loop's executor may be full of calls that wait on the very process that
    is gone, and a look through it would never run."""

    def __init__(
        self, processes: dict[str, str], on_gone: Callable[[str], object], every_s: float = CHECK_S
    ) -> None:
        self.processes = processes
        self.on_gone = on_gone
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No call of ``on_gone`` from now on (the thread ends within one look)."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        misses = dict.fromkeys(self.processes, 0)
        while not self._stop.wait(self.every_s):
            for what, address in self.processes.items():
                misses[what] = 0 if reachable(address) else misses[what] + 1
                if misses[what] >= MISSES and not self._stop.is_set():
                    self.on_gone(
                        f"Ray's {what} at {address} is gone (stopped with pdserve's process group or "
                        "control group? run pdserve under systemd with KillMode=mixed: deploy/systemd/)"
                    )
                    return


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


def shutdown_ray(grace_s: float = 2.0, gone: bool = False) -> None:
    """Stop the private Ray instance this process started, and then any of its processes that
    outlive it: Ray's agents linger for a minute when the instance stops while they start (a
    Ctrl-C during start-up). ``gone``: part of it is gone (``RayWatch``), so Ray's own
    shutdown, which waits on it, is skipped and the processes are stopped directly."""
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
    if gone:
        for p in started:
            with contextlib.suppress(psutil.Error):
                p.terminate()
    else:
        ray.shutdown()
    _, alive = psutil.wait_procs(started, timeout=grace_s)
    for p in alive:
        log.warning("killing Ray process %d (%s), still running after the shutdown", p.pid, p.name())
        with contextlib.suppress(psutil.Error):
            p.kill()
