"""The cluster-status document (same content over HTTP as JSON and over gRPC)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.worker.messages import WorkerLoad


def worker_json(w: WorkerLoad) -> dict[str, Any]:
    return {
        "worker_id": w.worker_id,
        "role": w.role.value,
        "address": w.address,
        "running": w.running,
        "waiting": w.waiting,
        "kv_blocks": {"total": w.kv_total, "free": w.kv_free, "cached": w.kv_cached},
        "health": w.health.value,
        "tp": w.tp,
    }


def cluster_status_json(ready: bool, mode: str, workers: Sequence[WorkerLoad]) -> dict[str, Any]:
    return {"ready": ready, "mode": mode, "workers": [worker_json(w) for w in workers]}
