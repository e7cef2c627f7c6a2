"""Shared pieces of child manifests: names, labels, owner references, pod hardening."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from flowprefill.contracts.deployment import OFFLINE_ENV
from flowprefill.contracts.processes import ProcessSpec

from .. import API_VERSION, MANAGED_BY
from ..models import ServingPoolSpec

Manifest = dict[str, Any]

CONFIG_HASH = "flowprefill.io/config-hash"
POOL_LABEL = "flowprefill.io/pool"
SERVICE_LABEL = "flowprefill.io/service"
ROLE_LABEL = "flowprefill.io/role"


@dataclass(frozen=True)
class PoolRef:
    """A ServingPool as the builders need it: identity plus parsed spec."""

    name: str
    namespace: str
    uid: str
    spec: ServingPoolSpec


def component_labels(service: str, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "flowprefill",
        "app.kubernetes.io/instance": service,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        SERVICE_LABEL: service,
        ROLE_LABEL: role,
    }


def pool_selector(pool_name: str) -> dict[str, str]:
    """Labels that select exactly one pool's pods (stable: Deployment selectors are immutable)."""
    return {"app.kubernetes.io/managed-by": MANAGED_BY, POOL_LABEL: pool_name}


def gateway_selector(service: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/managed-by": MANAGED_BY,
        SERVICE_LABEL: service,
        ROLE_LABEL: "gateway",
    }


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def owner_reference(pool: PoolRef, *, controller: bool) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ServingPool",
        "name": pool.name,
        "uid": pool.uid,
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def metadata(
    name: str, namespace: str, labels: dict[str, str], owners: list[dict[str, Any]]
) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels, "ownerReferences": owners}


def config_hash(data: dict[str, str]) -> str:
    """Short digest of ConfigMap data; a change rolls the pods that read it at start."""
    text = json.dumps(data, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def configmap(meta: dict[str, Any], data: dict[str, str]) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def http_probes(port: str, process: ProcessSpec, *, startup_s: int) -> dict[str, Any]:
    """Liveness on the process's health path, readiness on its ready path; a startup probe
    covers model loading."""
    return probes_at(port, process.health_path, process.ready_path, startup_s=startup_s)


def probes_at(port: str, health_path: str, ready_path: str, *, startup_s: int) -> dict[str, Any]:
    """:func:`http_probes` on given paths (a colocated pod's launcher answers for both of
    its processes)."""
    return {
        "startupProbe": {
            "httpGet": {"path": health_path, "port": port},
            "periodSeconds": 10,
            "failureThreshold": max(1, startup_s // 10),
        },
        "livenessProbe": {
            "httpGet": {"path": health_path, "port": port},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {"path": ready_path, "port": port},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
    }


def pod_security_context() -> dict[str, Any]:
    """Restricted Pod Security Standard and OpenShift's restricted-v2 alike: no UIDs (the
    image's numeric non-root USER, or the UID the platform assigns); a pool's
    ``pod.securityContext`` adds what its cluster wants (e.g. fsGroup for a claim)."""
    return {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(add: list[str] | None = None) -> dict[str, Any]:
    """No privilege escalation, a read-only root, every capability dropped but ``add``
    (a pool's ``IPC_LOCK`` with nixl over RDMA: the ``restricted`` Pod Security Standard
    refuses that one)."""
    capabilities: dict[str, list[str]] = {"drop": ["ALL"]}
    if add:
        capabilities["add"] = list(add)
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": capabilities,
    }


def scratch_volumes(
    shm_size_limit: str | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Writable /tmp (caches, HOME) and a memory-backed /dev/shm for torch/NCCL (the
    container runtime's own is 64 MiB); its pages count against the pod's memory."""
    shm: dict[str, Any] = {"medium": "Memory"}
    if shm_size_limit is not None:
        shm["sizeLimit"] = shm_size_limit
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "dshm", "emptyDir": shm}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"}]
    return volumes, mounts


SCRATCH_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
    *({"name": k, "value": v} for k, v in OFFLINE_ENV.items()),
]
