"""The Kubernetes manifests (``deploy/k8s``), rendered by kustomize and checked offline against
the API's schemas, the upstream CRDs and pdserve's deployment policies; deliberately broken
copies are each rejected with a message naming the field."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes_validate")
pytest.importorskip("jsonschema")

from tests.deploy.manifests import CRD_DIR, crd_schemas, problems, render

OVERLAYS = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "overlays"
pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")

Docs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def schemas() -> dict[tuple[str, str], dict[str, Any]]:
    if not CRD_DIR.is_dir():
        pytest.skip(f"the upstream CRDs are not at {CRD_DIR}")
    return crd_schemas()


@pytest.fixture(scope="module")
def rendered() -> dict[str, Docs]:
    return {overlay.name: render(overlay) for overlay in sorted(OVERLAYS.iterdir())}


def test_every_overlay_renders_and_passes(rendered: dict[str, Docs], schemas: Any) -> None:
    assert set(rendered) == {"cpu-demo", "gpu"}
    for name, docs in rendered.items():
        kinds = sorted(d["kind"] for d in docs)
        assert kinds == sorted(["RayCluster", "Service", "Service", "PodDisruptionBudget", "NetworkPolicy",
                                "ServiceMonitor", "ConfigMap"]), (name, kinds)  # fmt: skip
        assert problems(docs, schemas) == [], name


def _one(docs: Docs, kind: str, name: str | None = None) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def _router(docs: Docs) -> dict[str, Any]:
    return _one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]


def _worker_pod(docs: Docs) -> dict[str, Any]:
    return _one(docs, "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]


def _set(path: str, value: Any) -> Callable[[Docs], None]:
    def apply(docs: Docs) -> None:
        kind, _, rest = path.partition(":")
        node: Any = _one(docs, kind)
        keys = rest.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if k.isdigit() else node[k]
        node[keys[-1]] = value

    return apply


def _pop_probe(docs: Docs) -> None:
    del _router(docs)["readinessProbe"]


def _no_memory_shm(docs: Docs) -> None:
    _worker_pod(docs)["volumes"][0]["emptyDir"] = {}


def _gpu_mismatch(docs: Docs) -> None:
    _worker_pod(docs)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 2


def _latest(docs: Docs) -> None:
    _worker_pod(docs)["containers"][0]["image"] = "ghcr.io/pdserve/pdserve:latest"


def _untagged(docs: Docs) -> None:
    _router(docs)["image"] = "ghcr.io/pdserve/pdserve"


def _privileged(docs: Docs) -> None:
    _worker_pod(docs)["containers"][0]["securityContext"]["privileged"] = True


def _no_memory_limit(docs: Docs) -> None:
    del _router(docs)["resources"]["limits"]["memory"]


def _long_drain(docs: Docs) -> None:
    _router(docs)["args"] = [a if not a.startswith("--drain-timeout=") else "--drain-timeout=120"
                             for a in _router(docs)["args"]]  # fmt: skip


def _starved_replicas(docs: Docs) -> None:
    _router(docs)["args"] = [
        a if not a.startswith("--routers=") else "--routers=4" for a in _router(docs)["args"]
    ]


def _unknown_kind(docs: Docs) -> None:
    _one(docs, "RayCluster")["apiVersion"] = "ray.io/v9"


BROKEN: dict[str, tuple[str, Callable[[Docs], None], str]] = {
    # name: (overlay, breakage, a part of the message that names the field)
    "raycluster typo field": ("cpu-demo", _set("RayCluster:spec.workerGroupSpecs.0.replica", 3),
                              "spec.workerGroupSpecs[0]: Additional properties are not allowed ('replica'"),
    "raycluster wrong type": ("cpu-demo", _set("RayCluster:spec.workerGroupSpecs.0.maxReplicas", "eight"),
                              "spec.workerGroupSpecs[0].maxReplicas: 'eight' is not of type 'integer'"),
    "raycluster bad enum": ("cpu-demo", _set("RayCluster:spec.autoscalerOptions.upscalingMode", "Fast"),
                            "spec.autoscalerOptions.upscalingMode: 'Fast' is not one of"),
    "no readiness probe": ("cpu-demo", _pop_probe, "containers[1].readinessProbe: the router needs one"),
    "head grace too short": ("cpu-demo", _set("RayCluster:spec.headGroupSpec.template.spec."
                                              "terminationGracePeriodSeconds", 30),
                             "headGroupSpec.template.spec.terminationGracePeriodSeconds: 30 < preStop"),
    "drain outlasts grace": ("gpu", _long_drain,
                             "terminationGracePeriodSeconds: 60 < preStop + drain + 10 = 135"),
    "worker grace too short": ("cpu-demo", _set("RayCluster:spec.workerGroupSpecs.0.template.spec."
                                                "terminationGracePeriodSeconds", 20),
                               "workerGroupSpecs[0].template.spec.terminationGracePeriodSeconds: 20 < "
                               "worker drain"),
    "shm on disk": ("cpu-demo", _no_memory_shm,
                    "containers[0].volumeMounts: /dev/shm must be a memory-backed"),
    "gpu requests != limits": ("gpu", _gpu_mismatch,
                               "resources: nvidia.com/gpu requests (1) must equal limits (2)"),
    "latest tag": ("gpu", _latest, "containers[0].image: 'ghcr.io/pdserve/pdserve:latest' is not pinned"),
    "untagged image": ("cpu-demo", _untagged,
                       "containers[1].image: 'ghcr.io/pdserve/pdserve' is not pinned"),
    "privileged": ("cpu-demo", _privileged, "containers[0].securityContext.privileged: must not be true"),
    "no memory limit": ("cpu-demo", _no_memory_limit, "containers[1].resources.limits.memory: must be set"),
    "service port not a number": ("cpu-demo", _set("Service:spec.ports.0.port", "eighty"),
                                  "spec.ports.0.port: 'eighty' is not of type 'integer'"),
    "networkpolicy typo": ("cpu-demo", _set("NetworkPolicy:spec.ingres", []),
                           "spec: Additional properties are not allowed ('ingres'"),
    "servicemonitor typo": ("gpu", _set("ServiceMonitor:spec.endpoints.0.intervall", "15s"),
                            "spec.endpoints[0]: Additional properties are not allowed ('intervall'"),
    "unknown custom kind": ("cpu-demo", _unknown_kind, "apiVersion/kind: no schema for ray.io/v9 RayCluster"),
    "router replicas without cores": ("cpu-demo", _starved_replicas,
                                      "containers[1].resources.requests.cpu: 3 cores for --routers=4"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_manifest_is_rejected_naming_the_field(
    case: str, rendered: dict[str, Docs], schemas: Any
) -> None:
    overlay, breakage, expected = BROKEN[case]
    docs = copy.deepcopy(rendered[overlay])
    breakage(docs)
    found = problems(docs, schemas)
    assert any(expected in p for p in found), found


def test_int_or_string_and_quantities_are_accepted(rendered: dict[str, Docs], schemas: Any) -> None:
    docs = copy.deepcopy(rendered["cpu-demo"])
    _one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] = "50%"
    _worker_pod(docs)["containers"][0]["resources"]["requests"]["cpu"] = 2  # an integer quantity
    _worker_pod(docs)["containers"][0]["resources"]["limits"]["cpu"] = 2
    assert problems(docs, schemas) == []
