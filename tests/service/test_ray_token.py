"""Joining a token-protected Ray cluster without its token fails at once, in one line that
names the address and the token to pass (Ray alone retries the refusal for about 20 s, then says
only "Failed to connect to Ray cluster"); with the token it joins.

Kept to itself: its own HOME, auth token, GCS port and temp dir; it never runs ``ray stop`` (which
stops every Ray on the machine) but kills the processes that carry its token.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.client import free_port
from tests.service.helpers import kill_token_holders

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
JOIN = """
import sys
from pdserve.deploy.ray_instance import start_ray
start_ray(sys.argv[1], 1)
print("joined")
"""


@pytest.fixture(scope="module")
def head() -> Iterator[tuple[str, str]]:
    """(address, token) of a one-node cluster with token auth on."""
    # Short: Ray's unix sockets live under the temp dir, and their paths have a length limit.
    root = Path(tempfile.mkdtemp(prefix="pdrt", dir="/tmp"))
    (root / "home").mkdir()
    token, port = secrets.token_hex(32), free_port()
    env = {**os.environ, "HOME": str(root / "home"), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env.pop("RAY_ADDRESS", None)
    cmd = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
           "--num-cpus=1", f"--temp-dir={root / 'ray'}", "--disable-usage-stats",
           "--include-dashboard=false"]  # fmt: skip
    try:
        started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        yield f"127.0.0.1:{port}", token
    finally:
        kill_token_holders(token)
        shutil.rmtree(root, ignore_errors=True)


def join(address: str, home: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", JOIN, address], env={**clean, "HOME": str(home), **env},
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    return out, time.monotonic() - t0


def test_a_missing_token_is_named_at_the_first_refusal(head: tuple[str, str], tmp_path: Path) -> None:
    address, token = head
    out, took = join(address, tmp_path)
    assert out.returncode != 0 and "joined" not in out.stdout
    assert f"the Ray cluster at {address} requires token authentication, and no token was given" in out.stderr
    assert "RAY_AUTH_TOKEN=<token>" in out.stderr and "RAY_AUTH_MODE=token" in out.stderr
    assert out.stderr.count("InvalidAuthToken") <= 1, out.stderr[-3000:]
    assert took < 10, f"{took:.1f} s"
    out, _ = join(address, tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-" + token)
    assert "refused the token from RAY_AUTH_TOKEN" in out.stderr, out.stderr[-3000:]
    out, _ = join(address, tmp_path, RAY_AUTH_TOKEN=token)  # the mode left out: Ray would not send it
    assert "RAY_AUTH_MODE is not 'token'" in out.stderr, out.stderr[-3000:]


def test_the_token_in_a_file_joins(head: tuple[str, str], tmp_path: Path) -> None:
    address, token = head
    (tmp_path / "token").write_text(token + "\n")
    out, _ = join(address, tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"))
    assert out.returncode == 0 and "joined" in out.stdout, out.stderr[-3000:]
