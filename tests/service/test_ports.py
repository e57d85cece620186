"""The front ends' ports are bound before anything slow starts: a taken port fails the start
at once, and nothing started meanwhile can take them."""

from __future__ import annotations

import concurrent.futures
import errno
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from pdserve.deploy.pools import PoolSpec
from pdserve.deploy.service import Service, ServiceThread
from pdserve.router.config import RouterConfig
from tests.service.helpers import MODEL, engine_config


def _service(http_port: int = 0, grpc_port: int = 0) -> Service:
    spec = PoolSpec(prefill=1, decode=1, engine=engine_config())
    config = RouterConfig(http_port=http_port, grpc_port=grpc_port, model_name=MODEL)
    return Service(spec, config, use_ray=False)


def _bind_fails(port: int) -> bool:
    """Whether another server could not take ``port`` on 127.0.0.1 (with SO_REUSEADDR, as servers
    bind)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        s.listen()
    except OSError as e:
        assert e.errno == errno.EADDRINUSE, e
        return True
    finally:
        s.close()
    return False


@pytest.mark.parametrize("taken", ["http", "grpc"])
def test_a_taken_port_fails_the_start_before_any_worker_starts(taken: str) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    service = _service(**{f"{taken}_port": port})
    launched: list[Any] = []
    service._launch = lambda *a, **k: launched.append(a)  # type: ignore[method-assign]
    st = ServiceThread(service)
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError, match=f"127.0.0.1:{port}") as e:
            st.start()
        assert time.monotonic() - t0 < 5
        assert taken in str(e.value).lower()
        assert launched == [] and service.handles == []
    finally:
        st.stop()
        holder.close()
    # the other front end's port, bound before the failure, was let go: a fresh start works
    st = ServiceThread(_service())
    try:
        ep = st.start()
        assert httpx.get(f"{ep.http}/health", timeout=10).status_code == 200
    finally:
        st.stop()


def test_the_ports_are_held_while_the_workers_start_and_served_after() -> None:
    service = _service()
    launch = service._launch
    release = threading.Event()

    def slow_launch(*a: Any, **k: Any) -> Any:
        release.wait(30)
        return launch(*a, **k)

    service._launch = slow_launch  # type: ignore[method-assign]
    st = ServiceThread(service)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = pool.submit(st.start)
        try:
            deadline = time.monotonic() + 30
            while service.frontends is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert service.frontends is not None and not started.done()
            http, grpc = service.frontends.http_port, service.frontends.grpc_port
            assert _bind_fails(http) and _bind_fails(grpc)
            release.set()
            ep = started.result(60)
            assert ep.http.endswith(f":{http}") and ep.grpc.endswith(f":{grpc}")
            assert httpx.get(f"{ep.http}/health", timeout=10).status_code == 200
        finally:
            release.set()
            st.stop()
    assert not _bind_fails(http) and not _bind_fails(grpc)
