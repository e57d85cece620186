"""The Ray instance's process groups and the watch on its control plane, without Ray: Ray's
launcher stood in for by ``subprocess.Popen``, its processes by listening sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.deploy import ray_instance
from pdserve.deploy.ray_instance import RayWatch, own_process_groups, reachable


def test_processes_started_inside_get_a_process_group_of_their_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What Ray's launcher starts under ``own_process_groups`` leads a process group of its own
    (a signal to pdserve's group does not reach it), and Ray's own start-up hook still runs."""
    from ray._private import services

    monkeypatch.setattr(services, "ConsolePopen", subprocess.Popen)  # (Ray's, on Linux)
    hook = tmp_path / "hook"
    probe = [sys.executable, "-c", "import os; print(os.getpgid(0), os.getpid())"]
    with own_process_groups():
        inside = services.ConsolePopen(probe, stdout=subprocess.PIPE, text=True,
                                       preexec_fn=lambda: hook.write_text("ran"))  # fmt: skip
        out, _ = inside.communicate(timeout=30)
    pgid, pid = map(int, out.split())
    assert pgid == pid != os.getpgid(0) and hook.read_text() == "ran"
    assert services.ConsolePopen is subprocess.Popen  # put back
    outside = subprocess.run(probe, capture_output=True, text=True, check=True, timeout=30)
    assert int(outside.stdout.split()[0]) == os.getpgid(0)


def listener() -> tuple[socket.socket, str]:
    sock = socket.create_server(("127.0.0.1", 0))
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


def test_the_watch_says_which_process_went_and_only_once() -> None:
    gcs, gcs_at = listener()
    raylet, raylet_at = listener()
    calls: list[str] = []
    called = threading.Event()
    watch = RayWatch({"GCS": gcs_at, "raylet": raylet_at}, lambda why: (calls.append(why), called.set()),
                     every_s=0.05)  # fmt: skip
    watch.start()
    try:
        time.sleep(0.3)
        assert calls == []  # both there: nothing to say
        raylet.close()
        t0 = time.monotonic()
        assert called.wait(5)
        assert time.monotonic() - t0 < 1.0
        time.sleep(0.3)
        assert len(calls) == 1 and f"raylet at {raylet_at} is gone" in calls[0]
        assert "KillMode=mixed" in calls[0]
    finally:
        watch.stop()
        gcs.close()


def test_a_stopped_watch_says_nothing() -> None:
    gcs, gcs_at = listener()
    calls: list[Any] = []
    watch = RayWatch({"GCS": gcs_at}, calls.append, every_s=0.05)
    watch.start()
    watch.stop()
    gcs.close()  # stopped on purpose after the watch
    time.sleep(0.4)
    assert calls == [] and watch.stopped


def test_reachable() -> None:
    sock, at = listener()
    assert reachable(at)
    sock.close()
    assert not reachable(at) and not reachable("nonsense") and not reachable("127.0.0.1:notaport")


def test_only_looks_every_so_often() -> None:
    assert ray_instance.CHECK_S * ray_instance.MISSES <= 3.0  # pdserve hears of a lost GCS in seconds
