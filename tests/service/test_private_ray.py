"""Without an address, ``start_ray`` starts a private Ray instance whatever the machine says:
a RAY_ADDRESS left in the environment (or a ``ray start`` cluster's record) is not joined."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import ray
from pdserve.deploy.ray_pools import start_ray
assert start_ray(None, 1) is True
print("gcs", ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


def test_no_address_means_a_private_instance_even_with_ray_address_set() -> None:
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}  # nothing listens there
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    gcs = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("gcs "))
    assert not gcs.endswith(":1"), gcs
