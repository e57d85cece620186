"""Offline checks of rendered Kubernetes manifests: the API's schemas and pdserve's policies.

- Core kinds: ``kubernetes-validate --strict`` (the upstream OpenAPI schemas; unknown fields are
  errors).
- Custom resources (RayCluster, RayService, ServiceMonitor, ...): the ``openAPIV3Schema`` of the
  upstream CRD (``shared/data/k8s-crds``) as a JSON Schema, as strict as the API server's
  field validation: unknown fields are errors unless the schema preserves them, and
  ``x-kubernetes-int-or-string`` accepts an integer or a string. A kind with no schema is an
  error, never a warning.
- Policies: probes on the router, grace periods that outlast preStop + drain + 10 s, a
  memory-backed ``/dev/shm`` on workers, requests and limits on every container (GPU requests =
  limits), pinned image tags, nothing privileged.

Every problem is one line that starts with the document and the field it is about.
"""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

K8S_VERSION = "1.32"
CRD_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "k8s-crds"
MARGIN_S = 10


def render(kustomization: Path) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(kustomization)], capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _strict(node: Any) -> Any:
    """A CRD's structural schema as a JSON Schema the API server's strictness."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    closed = "properties" in node and "additionalProperties" not in node
    if closed and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_schemas(crd_dir: Path = CRD_DIR) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> JSON Schema, for every version of every CRD in ``crd_dir``."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = _strict(version["schema"]["openAPIV3Schema"])
            schema.setdefault("properties", {})["metadata"] = {"type": "object"}
            schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def _name(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"


def schema_problems(doc: dict[str, Any], schemas: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    key = (str(doc.get("apiVersion")), str(doc.get("kind")))
    if key in schemas:
        validator = jsonschema.Draft7Validator(schemas[key])
        return [f"{_name(doc)}: {e.json_path.lstrip('$.') or '(root)'}: {e.message}"
                for e in sorted(validator.iter_errors(doc), key=lambda e: e.json_path)]  # fmt: skip
    try:
        kubernetes_validate.validate(copy.deepcopy(doc), K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{_name(doc)}: apiVersion/kind: no schema for {key[0]} {key[1]} (not a known kind)"]
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "(root)"
        return [f"{_name(doc)}: {where}: {e.message}"]
    return []


def pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(field path, role, pod spec) of every pod template in a document."""
    spec = doc.get("spec") or {}
    if doc.get("kind") == "RayCluster":
        yield "spec.headGroupSpec.template.spec", "head", spec["headGroupSpec"]["template"]["spec"]
        for i, group in enumerate(spec.get("workerGroupSpecs") or []):
            yield f"spec.workerGroupSpecs[{i}].template.spec", "worker", group["template"]["spec"]
    elif "template" in spec:
        yield "spec.template.spec", "pod", spec["template"]["spec"]


def _flag(args: list[str], name: str, default: float) -> float:
    for i, a in enumerate(args):
        if a.startswith(f"{name}="):
            return float(a.split("=", 1)[1])
        if a == name and i + 1 < len(args):
            return float(args[i + 1])
    return default


def _cores(quantity: str | int | float) -> float:
    """A Kubernetes CPU quantity ("3", "500m", 2) in cores."""
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _prestop_s(container: dict[str, Any]) -> float:
    pre_stop = (container.get("lifecycle") or {}).get("preStop") or {}
    command = (pre_stop.get("exec") or {}).get("command") or []
    return float(command[1]) if len(command) == 2 and command[0] == "sleep" else 0.0


def _router(pod: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    for i, c in enumerate(pod.get("containers") or []):
        if (c.get("command") or [])[:2] == ["pdserve", "serve"]:
            return i, c
    return None


def policy_problems(docs: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    router_args: list[str] = []
    for doc in docs:
        for _, _, pod in pod_templates(doc):
            found = _router(pod)
            if found:
                router_args = list(found[1].get("args") or [])
    worker_drain = _flag(router_args, "--worker-drain-timeout", 30.0)
    for doc in docs:
        for path, role, pod in pod_templates(doc):
            where = f"{_name(doc)}: {path}"
            grace = float(pod.get("terminationGracePeriodSeconds", 30))
            if pod.get("hostNetwork") or pod.get("hostPID"):
                problems.append(f"{where}.hostNetwork/hostPID: must not share the node's namespaces")
            found = _router(pod)
            if found is not None:
                i, router = found
                cpath = f"{where}.containers[{i}]"
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if not router.get(probe):
                        problems.append(f"{cpath}.{probe}: the router needs one")
                routers = int(_flag(list(router.get("args") or []), "--routers", 1.0))
                cpus = _cores(((router.get("resources") or {}).get("requests") or {}).get("cpu", "0"))
                if routers > 1 and cpus < routers + 1:
                    problems.append(f"{cpath}.resources.requests.cpu: {cpus:g} cores for "
                                    f"--routers={routers}: each replica streams on a core of its own, "
                                    f"the pool owner needs one more ({routers + 1})")  # fmt: skip
                drain = _flag(list(router.get("args") or []), "--drain-timeout", 30.0)
                need = _prestop_s(router) + drain + MARGIN_S
                if grace < need:
                    problems.append(f"{where}.terminationGracePeriodSeconds: {grace:g} < preStop + drain + "
                                    f"{MARGIN_S} = {need:g}; long streams would be cut")  # fmt: skip
            if role == "worker":
                if grace < worker_drain + MARGIN_S:
                    problems.append(f"{where}.terminationGracePeriodSeconds: {grace:g} < worker drain "
                                    f"{worker_drain:g} + {MARGIN_S}")  # fmt: skip
                volumes = {v.get("name"): v for v in pod.get("volumes") or []}
                for i, c in enumerate(pod.get("containers") or []):
                    mounts = {m.get("mountPath"): m.get("name") for m in c.get("volumeMounts") or []}
                    shm = volumes.get(mounts.get("/dev/shm"), {}).get("emptyDir")
                    if not shm or shm.get("medium") != "Memory":
                        problems.append(f"{where}.containers[{i}].volumeMounts: /dev/shm must be a "
                                        "memory-backed emptyDir (KV caches live there)")  # fmt: skip
            for kind in ("containers", "initContainers"):
                for i, c in enumerate(pod.get(kind) or []):
                    problems += _container_problems(f"{where}.{kind}[{i}]", c)
    return problems


# A digest, or a tag other than "latest" (after an optional registry host:port).
_PINNED = re.compile(r"^[^@]+@sha256:[0-9a-f]{64}$|^([^/]+/)*[^/:@]+:(?!latest$)\w[\w.-]*$")


def _container_problems(cpath: str, c: dict[str, Any]) -> list[str]:
    problems = []
    image = str(c.get("image", ""))
    if not _PINNED.match(image):
        problems.append(f"{cpath}.image: {image!r} is not pinned (a version tag or a digest, not latest)")
    resources = c.get("resources") or {}
    for side in ("requests", "limits"):
        for what in ("cpu", "memory"):
            if what not in (resources.get(side) or {}):
                problems.append(f"{cpath}.resources.{side}.{what}: must be set")
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    for key in set(requests) | set(limits):
        if key.endswith("/gpu") and str(requests.get(key)) != str(limits.get(key)):
            problems.append(f"{cpath}.resources: {key} requests ({requests.get(key)}) must equal limits "
                            f"({limits.get(key)})")  # fmt: skip
    security = c.get("securityContext") or {}
    if security.get("privileged"):
        problems.append(f"{cpath}.securityContext.privileged: must not be true")
    if security.get("allowPrivilegeEscalation", True) is not False:
        problems.append(f"{cpath}.securityContext.allowPrivilegeEscalation: must be false")
    return problems


def problems(docs: list[dict[str, Any]], schemas: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    found: list[str] = []
    for doc in docs:
        found += schema_problems(doc, schemas)
    return found + policy_problems(docs)
