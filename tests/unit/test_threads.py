"""Torch threads from a process's CPU allotment (``pdserve.model_runtime.platform``): never
torch's default of every core, which on a busy host makes each step wait on the busiest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.model_runtime import platform


@pytest.mark.parametrize(
    ("cpu_max", "want"),
    [("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000\n", 1), ("200000 100000", 2), ("", None)],
)
def test_the_cgroup_quota_in_whole_cpus(tmp_path: Path, cpu_max: str, want: int | None) -> None:
    f = tmp_path / "cpu.max"
    f.write_text(cpu_max)
    assert platform._cgroup_cpus(str(f)) == want
    assert platform._cgroup_cpus(str(tmp_path / "absent")) is None


def test_the_allotment_is_the_affinity_capped_by_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(platform, "_cgroup_cpus", lambda: None)
    assert platform.cpu_allotment() == 4
    monkeypatch.setattr(platform, "_cgroup_cpus", lambda: 2)
    assert platform.cpu_allotment() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert platform.cpu_allotment() == 1


def run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_threads_are_set_from_the_allotment_and_inter_op_is_one() -> None:
    got = run(
        "import torch; from pdserve.model_runtime import platform as p; "
        "p.cpu_allotment = lambda: 3; n = p.use_threads(0); "
        "print(n, torch.get_num_threads(), torch.get_num_interop_threads())"
    )
    assert got == "3 3 1"
    assert run("import torch; from pdserve.model_runtime.platform import use_threads; "
               "use_threads(2); use_threads(1); print(torch.get_num_threads())") == "1"  # fmt: skip


def test_generate_runs_on_one_thread_unless_told() -> None:
    """``pdserve generate`` as a worker's default: one thread (torch's default was every core)."""
    exe = str(Path(sys.executable).with_name("pdserve"))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    for flags, want in (([], "1 thread)"), (["--threads", "2"], "2 threads)")):
        cmd = [exe, "generate", "--model", "tiny", "--max-tokens", "2", *flags, "hi"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0 and want in out.stdout, out.stdout + out.stderr
