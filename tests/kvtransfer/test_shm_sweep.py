"""Cache files of workers killed without cleaning up are removed by the next worker that
allocates one on the host; live workers' files and other PID namespaces' are left alone."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from pdserve.kvtransfer.datapath import _pid_namespace, sweep_stale_caches


def test_only_files_of_dead_processes_of_this_namespace_go(tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    dead, ns = child.pid, _pid_namespace()
    names = {
        "dead": f"pdserve-kv-{ns}-{dead}-{'a' * 16}",
        "alive": f"pdserve-kv-{ns}-{os.getpid()}-{'b' * 16}",
        "other_namespace": f"pdserve-kv-{ns + 1}-{dead}-{'c' * 16}",
        "not_ours": f"other-{ns}-{dead}-{'d' * 16}",
        "malformed": f"pdserve-kv-{ns}-{dead}-zz",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"kv")
    removed = sweep_stale_caches(tmp_path)
    assert removed == [tmp_path / names["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "dead")
    assert sweep_stale_caches(tmp_path / "missing") == []
