"""The chart on OpenShift and PSA-restricted clusters, with the real helm binary: no
hard-coded UIDs, restricted security contexts (and a check that can fail), and the
finalizers RBAC that OwnerReferencesPermissionEnforcement needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.operator.chart import operator_roles
from tests.operator.test_operator_helm import CASES, _allowed, _operator_pod, template

# --------------------------------------------------------- OpenShift: UIDs, restricted

UID_KEYS = {"runAsUser", "runAsGroup", "fsGroup", "supplementalGroups"}


def _keys(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every (dotted path, value) of a manifest, recursively."""
    if isinstance(node, dict):
        return [
            kv for k, v in node.items() for kv in [(f"{path}.{k}", v), *_keys(v, f"{path}.{k}")]
        ]
    if isinstance(node, list):
        return [kv for i, v in enumerate(node) for kv in _keys(v, f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("case", CASES)
def test_no_rendered_object_hard_codes_a_uid(helm: Path, case: str) -> None:
    """OpenShift's restricted-v2 SCC assigns each namespace a UID range and refuses pods
    asking for a UID outside it: the chart sets none (the image's numeric USER applies,
    or the assigned one). CRDs are not scanned: their schemas name these fields."""
    docs = template(helm, CASES[case], "--kube-version", "1.30.0")
    found = [
        (d["kind"], path)
        for d in docs
        if d["kind"] != "CustomResourceDefinition"  # templates/crds.yaml
        for path, _ in _keys(d)
        if path.rsplit(".", 1)[-1] in UID_KEYS
    ]
    assert found == []


def test_a_user_set_security_context_renders(helm: Path) -> None:
    docs = template(
        helm,
        [
            "--set", "podSecurityContext.runAsUser=1000680000",
            "--set", "podSecurityContext.fsGroup=1000680000",
            "--set", "securityContext.runAsGroup=1000680000",
        ],
    )  # fmt: skip
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 1000680000
    assert pod["securityContext"]["fsGroup"] == 1000680000
    assert pod["securityContext"]["runAsNonRoot"] is True  # the defaults stay
    assert pod["containers"][0]["securityContext"]["runAsGroup"] == 1000680000
    assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False


RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The Pod Security Standard "restricted" (what OpenShift's restricted-v2 SCC also
    demands, less its UID range) for a pod spec: a list of what breaks it."""
    out = []
    psc = pod.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            out.append(flag)
    for volume in pod.get("volumes", []):
        if not set(volume) - {"name"} <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}")
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            out.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation")
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities add")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
    return out


@pytest.mark.parametrize("case", CASES)
def test_the_operator_pod_passes_restricted(helm: Path, case: str) -> None:
    pod = _operator_pod(template(helm, CASES[case]))
    assert restricted_violations(pod) == []
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # kopf's identity (getpass.getuser) must not need a passwd entry for the UID.
    assert {"name": "USER", "value": "flowprefill"} in container["env"]


@pytest.mark.parametrize(
    ("setting", "violation"),
    [
        ("securityContext.allowPrivilegeEscalation=true", "operator: allowPrivilegeEscalation"),
        ("podSecurityContext.runAsNonRoot=false", "operator: runAsNonRoot"),
        ("podSecurityContext.seccompProfile.type=Unconfined", "operator: seccompProfile"),
        ("securityContext.capabilities.drop=null", "operator: capabilities drop ALL"),
    ],
)
def test_the_restricted_check_can_fail(helm: Path, setting: str, violation: str) -> None:
    pod = _operator_pod(template(helm, ["--set", setting]))
    assert violation in restricted_violations(pod)


@pytest.mark.parametrize("case", ["default", "namespaced", "ha-namespaced", "cluster"])
def test_every_role_grants_the_pools_finalizers(helm: Path, case: str) -> None:
    """Each Role (one per watched namespace) or the ClusterRole on its own grants update
    on servingpools/finalizers, and nothing more on any finalizers; the users' aggregated
    roles grant none."""
    docs = template(helm, CASES[case])
    roles = operator_roles(docs)
    assert roles
    for user_role in (d for d in docs if d["kind"] == "ClusterRole" and d not in roles):
        assert not any(
            r.endswith("/finalizers") for u in user_role["rules"] for r in u["resources"]
        )
    for role in roles:
        assert _allowed(role["rules"], "flowprefill.io", "servingpools/finalizers", "update")
        for rule in role["rules"]:
            if any(r.endswith("/finalizers") for r in rule["resources"]):
                assert rule == {
                    "apiGroups": ["flowprefill.io"],
                    "resources": ["servingpools/finalizers"],
                    "verbs": ["update"],
                }
