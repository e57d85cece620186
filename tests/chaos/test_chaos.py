"""The chaos suite: each fault of ``benchmarks/chaos.py`` against a real 2 prefill + 2 decode
deployment on a local Ray cluster, one for every scenario and whole again before each
(``router_term``, first: ``pdserve serve`` in a child process), with greedy streams of mixed
lengths checked token by token against HF transformers.

Every scenario must end with no failed stream, no token lost or repeated, no KV block in use
and no per-request state left on any live worker; a killed process is seen within 0.5 s and a
stopped one within 5 s; the router's drain refuses what comes after its SIGTERM and exits
cleanly."""

from __future__ import annotations

import socket
import subprocess
from typing import Any

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

chaos = pytest.importorskip("benchmarks.chaos")

DETECTION_S = {"decode_kill": 0.5, "prefill_kill": 0.5, "prefill_push_kill": 0.5, "decode_stop": 5.0,
               "decode_term": 0.5, "shrink_then_crash": 0.5}  # fmt: skip


def can_reset_connections() -> bool:
    """``ss -K`` works here (it needs CAP_NET_ADMIN and the kernel's socket-destroy support)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        try:
            subprocess.run(["ss", "-K", "-t", "dst", "127.0.0.1", "dport", "=", f":{port}"],
                           capture_output=True, check=False, timeout=10)  # fmt: skip
            cli.settimeout(1)
            try:
                cli.send(b"x")
                return cli.recv(1) == b""
            except OSError:
                return True
        except (OSError, subprocess.SubprocessError):
            return False
        finally:
            cli.close()
            conn.close()


@pytest.fixture(scope="module")
def deployment(work: Any) -> Any:
    """One 2P+2D deployment for every scenario (each waits for it to be whole again: a worker
    lost or drained by the one before is replaced, as the product does)."""
    from pdserve.deploy.ray_instance import start_ray

    start_ray(None, 16)
    st, s = chaos.start(prefill=2, decode=2)
    yield st, s
    st.stop()


def test_router_term(work: Any) -> None:
    """First, before the shared deployment starts: ``pdserve serve`` in a child process of its
    own, SIGTERMed once every stream has tokens."""
    r = chaos.scenario("router_term", work)
    assert (r["failed"], r["tokens_lost"], r["tokens_duplicated"]) == (0, 0, 0), r
    assert r["succeeded"] == 8, r
    assert r["refused_after"] == r["after"] and r["clean_exit"], r


def test_group_sigterm(work: Any) -> None:
    """Before the shared deployment starts too: ``pdserve serve`` on its own private Ray instance,
    in a session of its own, with SIGTERM to its whole process group (``kill -TERM -- -PGID``,
    a supervisor's stop): Ray's processes must not get it, so the router drains, refuses the
    wave after it, and stops Ray in order, leaving no process of its session behind."""
    r = chaos.scenario("group_sigterm", work)
    assert (r["failed"], r["tokens_lost"], r["tokens_duplicated"]) == (0, 0, 0), r
    assert r["succeeded"] == 8, r
    assert r["refused_after"] == r["after"] and r["clean_exit"], r
    assert r["processes_left"] == 0 and r["exit_s"] < 30, r


ALONE = (*chaos.SERVE_ALONE, *chaos.REPLICATED)  # deployments of their own


@pytest.mark.parametrize("name", [n for n in chaos.SCENARIOS if n not in ALONE])
def test_scenario(name: str, work: Any, deployment: Any) -> None:
    if name in ("kv_drop", "kv_listener_flood") and not can_reset_connections():
        pytest.skip("ss -K cannot reset TCP connections here")
    r = chaos.scenario(name, work, deployment)
    assert (r["failed"], r["tokens_lost"], r["tokens_duplicated"]) == (0, 0, 0), r
    assert r["succeeded"] == 8 + 4, r
    assert (r["blocks_leaked"], r["state_left"]) == (0, 0), r
    if name in DETECTION_S:
        assert r["detection_s"] <= DETECTION_S[name], r
    victim_held = name != "shrink_then_crash" or r["held_at_shrink"][r["victim"]] > 0
    if name in ("decode_kill", "decode_stop", "shrink_then_crash") and victim_held:
        assert r["migrated"] >= 1, r  # the victim held streams, and they moved
    if name == "shrink_then_crash":
        assert r["shrink_given_up"], r  # the draining worker stayed and took the victim's streams
    if name == "decode_term":
        assert r["migrated"] == 0, r  # drained: every stream finished where it was
    if name == "kv_drop":
        assert r["kv_failed"] > 0, r  # transfers were really dropped (and recomputed)
    if name == "kv_listener_flood":  # every hand-off went through the flood, none recomputed
        assert r["kv_failed"] == 0 and r["handoffs"] == 8 + 4, r
        assert r["flood"]["closed_by_listener"] > 0, r  # the flood was really shed, and reopened
