"""The Helm chart with the real helm binary: lint, template, Kubernetes-schema validity."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.operator.chart import is_hook, operator_roles
from tests.operator.crdcheck import load_crds, validate_cr

CHART = Path(__file__).resolve().parents[2] / "charts" / "flowprefill"
# The chart's kubeVersion floor, the version most clusters run, and the first with
# ImageVolume on by default (the admission policy is rendered below it).
K8S_VERSIONS = ["1.30", "1.33", "1.35"]

CASES: dict[str, list[str]] = {
    "default": [],  # namespaced: the release namespace
    "namespaced": ["--set", "watch.scope=namespaced", "--set", "watch.namespaces={team-a,team-b}"],
    "cluster": ["--set", "watch.scope=cluster", "--set", "rbac.secretNames={hf-token,api-keys}"],
    "ha-cluster": [
        "--set", "replicaCount=2", "--set", "peering.enabled=true", "--set", "watch.scope=cluster",
    ],
    "crds-by-hand": ["--set", "crds.enabled=false", "--set", "rbac.aggregateToUserRoles=false"],
    "ha-namespaced": [
        "--set",
        "replicaCount=2",
        "--set",
        "peering.enabled=true",
        "--set",
        "watch.scope=namespaced",
    ],
    "observability": [
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "grafanaDashboard.enabled=true",
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        "image.digest=sha256:" + "a" * 64,
    ],
    "policies-tightened": [
        "--set",
        "watch.scope=namespaced",
        "--set",
        "networkPolicy.gatewayFrom[0].namespaceSelector.matchLabels.team=frontend",
        "--set",
        "networkPolicy.apiServerCIDRs={10.0.0.1/32}",
        "--set",
        "networkPolicy.kvOverHttp=false",
    ],
    "no-policies": ["--set", "networkPolicy.enabled=false"],
    "own-registry": [
        "--set", "image.registry=registry.example.com:5000/ml",
        "--set", "image.tag=2026.11.1",
        "--set", "imagePullSecrets[0].name=regcred",
        "--set", "children.decodeImage=registry.example.com:5000/vllm/decode@sha256:" + "b" * 64,
        "--set", "modelSources.hfEndpoint=https://hf-mirror.example.com:8443",
        "--set", "modelSources.hubCIDRs={10.20.0.0/16}",
        "--set", "networkPolicy.apiServerCIDRs={10.96.0.1/32}",
    ],
    "offline-openshift": [
        "--set", "modelSources.check=false",
        "--set", "modelSources.imageVolumes=disabled",
        "--set", "watch.scope=namespaced",
        "--set", "watch.namespaces={team-a,team-b}",
    ],
}  # fmt: skip


def run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)


def template(helm: Path, args: list[str], *extra: str) -> list[dict[str, Any]]:
    out = run(helm, "template", "fp", str(CHART), "-n", "flowprefill-system", *args, *extra)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("case", CASES)
def test_helm_lint(helm: Path, case: str) -> None:
    out = run(helm, "lint", "--strict", str(CHART), *CASES[case])
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_rendered_manifests_validate(helm: Path, case: str, k8s: str) -> None:
    docs = template(helm, CASES[case], "--include-crds", "--kube-version", f"{k8s}.0")
    # kopf's peering CRDs (crds/) and ours (files/crds/, rendered by templates/crds.yaml).
    crds = {**load_crds(CHART / "crds"), **load_crds(CHART / "files" / "crds")}
    kinds = set()
    for doc in docs:
        kinds.add(doc["kind"])
        if doc["kind"] == "ServiceMonitor":
            assert doc["spec"]["endpoints"][0]["port"] == "http"  # no schema for this CRD here
        elif doc["kind"] == "PodMonitor":  # the operator's own metrics
            assert doc["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        elif doc["kind"] == "PrometheusRule":  # the rules themselves: test_dashboard.py
            assert doc["spec"]["groups"][0]["rules"], "no recording rules"
        elif doc["apiVersion"].startswith("kopf.dev/"):
            assert (doc["apiVersion"], doc["kind"]) in crds
        else:
            kubernetes_validate.validate(doc, k8s, strict=True)
    assert {"Deployment", "ServiceAccount", "CustomResourceDefinition"} <= kinds
    # Below 1.35 (or with image volumes disabled) the ImageVolume gate is rendered, and
    # validated above like everything else.
    gated = k8s != "1.35" or "modelSources.imageVolumes=disabled" in CASES[case]
    assert gated == ("ValidatingAdmissionPolicy" in kinds), kinds
    assert gated == ("ValidatingAdmissionPolicyBinding" in kinds), kinds
    for doc in docs:
        if doc["apiVersion"].startswith("flowprefill.io/"):
            assert validate_cr(doc, crds) == []


def _operator_args(docs: list[dict[str, Any]]) -> list[str]:
    dep = next(d for d in docs if d["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kopf"]
    return list(container["args"])


@pytest.mark.parametrize("port", [8081, 0])
def test_the_operator_serves_its_metrics_where_the_chart_says(helm: Path, port: int) -> None:
    """The env the operator reads (settings.metrics_port), the container port a PodMonitor
    scrapes, and the NetworkPolicy's door for Prometheus agree; 0 turns all three off."""
    from flowprefill_operator.settings import OperatorSettings

    docs = template(helm, ["--set", f"operator.metricsPort={port}"])
    dep = next(d for d in docs if d["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    settings = OperatorSettings.from_env(env)
    assert settings.metrics_port == port and settings.autoscale_interval_s == 30
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    policy = next(d for d in policies if d["metadata"]["name"].endswith("-operator"))
    opened = {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
    if port:
        assert ports["metrics"] == port and port in opened
    else:
        assert "metrics" not in ports and opened == {ports["probe"]}


def test_scope_modes_and_least_privilege(helm: Path) -> None:
    cluster = template(helm, CASES["cluster"])
    assert "--all-namespaces" in _operator_args(cluster)
    assert "--standalone" in _operator_args(cluster)
    assert {d["kind"] for d in cluster} >= {"ClusterRole", "ClusterRoleBinding"}

    namespaced = template(helm, CASES["namespaced"])
    args = _operator_args(namespaced)
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "ClusterRoleBinding" not in {d["kind"] for d in namespaced}
    assert {r["kind"] for r in operator_roles(namespaced)} == {"Role"}
    roles = [d for d in namespaced if d["kind"] == "Role" and not is_hook(d)]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]

    for doc in cluster + namespaced:
        for rule in doc.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            if "secrets" in rule["resources"]:
                assert rule["resources"] == ["secrets"] and rule["verbs"] == ["get"], (
                    "only named Secrets, never list/watch"
                )
    # rbac.secretNames: the cluster-wide get is limited to the Secrets pools and classes name.
    (secret_rule,) = [
        r for d in operator_roles(cluster) for r in d["rules"] if "secrets" in r["resources"]
    ]
    assert secret_rule["resourceNames"] == ["hf-token", "api-keys"]


def _allowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(
        group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules
    )


# What the operator does (kube.py calls and kopf's own needs), per (group, resource).
NEEDED = {
    ("flowprefill.io", "servingpools"): ["get", "list", "watch", "patch"],
    ("flowprefill.io", "sloclasses"): ["get", "list", "watch", "patch"],
    ("flowprefill.io", "servingpools/status"): ["patch"],
    ("flowprefill.io", "sloclasses/status"): ["patch"],
    ("flowprefill.io", "servingpools/scale"): ["patch"],
    # blockOwnerDeletion on the children's ownerReferences (OwnerReferencesPermission-
    # Enforcement, on in OpenShift; test_namespaced_rbac.py enforces it).
    ("flowprefill.io", "servingpools/finalizers"): ["update"],
    ("apps", "deployments"): ["get", "create", "patch", "delete"],
    ("", "services"): ["get", "create", "patch", "delete"],
    ("", "configmaps"): ["get", "create", "patch", "delete"],
    ("", "pods"): ["get", "list"],
    ("", "secrets"): ["get"],
    ("", "persistentvolumeclaims"): ["get"],
    ("", "events"): ["create"],
    # The gateway's optional children (issue 22): PDB, HPA, Gateway API HTTPRoute.
    **{
        key: ["get", "list", "watch", "create", "update", "patch", "delete"]
        for key in (
            ("policy", "poddisruptionbudgets"),
            ("autoscaling", "horizontalpodautoscalers"),
            ("gateway.networking.k8s.io", "httproutes"),
        )
    },
}


@pytest.mark.parametrize(
    "case", ["default", "namespaced", "cluster", "ha-cluster", "ha-namespaced"]
)
def test_rbac_covers_what_the_operator_does(helm: Path, case: str) -> None:
    """Every Role (one per served namespace), or the ClusterRole, the operator is bound to
    grants what it does: NEEDED, and at least get on every kind its API layer knows
    (kube.RESOURCES, where a kind the operator starts to read or build must be added)."""
    from flowprefill_operator.kube import RESOURCES

    docs = template(helm, CASES[case])
    roles = operator_roles(docs)
    assert roles
    needed = dict(NEEDED)
    peering = "clusterkopfpeerings" if "watch.scope=cluster" in CASES[case] else "kopfpeerings"
    if "peering.enabled=true" in CASES[case]:
        needed[("kopf.dev", peering)] = ["get", "list", "watch", "patch"]
    for kind, (prefix, plural) in RESOURCES.items():
        group = prefix.removeprefix("/apis/").rpartition("/")[0] if prefix != "/api/v1" else ""
        verbs = needed.setdefault((group, plural), [])
        if kind != "Event":  # the operator only writes Events
            verbs.append("get")
    for role in roles:
        for (group, resource), verbs in needed.items():
            for verb in verbs:
                assert _allowed(role["rules"], group, resource, verb), f"{verb} {group}/{resource}"


def test_values_schema_refuses_bad_values(helm: Path) -> None:
    bad = run(helm, "template", "fp", str(CHART), "--set", "watch.scope=galaxy")
    assert bad.returncode != 0 and "watch" in bad.stderr
    typo = run(helm, "template", "fp", str(CHART), "--set", "replicaCont=2")
    assert typo.returncode != 0
    unpeered = run(helm, "template", "fp", str(CHART), "--set", "replicaCount=2")
    assert unpeered.returncode != 0 and "peering" in unpeered.stderr
    for bad_policy in (
        "networkPolicy.apiServerCIDRs={10.0.0.1}",  # no prefix length
        "networkPolicy.apiServerPorts={70000}",
        "networkPolicy.gatewayFrom[0].podSelectr.matchLabels.a=b",  # typo'd peer field
    ):
        refused = run(helm, "template", "fp", str(CHART), "--set", bad_policy)
        assert refused.returncode != 0 and "networkPolicy" in refused.stderr, bad_policy


def test_chart_crds_are_the_generated_ones(repo_root: Path) -> None:
    for path in (repo_root / "crds").glob("*.yaml"):
        assert (CHART / "files" / "crds" / path.name).read_text() == path.read_text()


def _leaf_paths(node: Any, prefix: str = "") -> set[str]:
    if isinstance(node, dict) and node and prefix.count(".") < 1:
        return {p for k, v in node.items() for p in _leaf_paths(v, f"{prefix}{k}.")} | (
            {prefix.rstrip(".")} if prefix else set()
        )
    return {prefix.rstrip(".")}


def test_every_value_is_documented_and_typed() -> None:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    for key, value in values.items():
        assert key in schema["properties"], f"{key} missing from values.schema.json"
        props = schema["properties"][key].get("properties")
        if isinstance(value, dict) and props is not None:
            assert set(value) == set(props), key
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if (
            not stripped
            or stripped.startswith("#")
            or stripped.startswith("-")
            or ":" not in stripped
        ):
            continue
        indent = len(line) - len(line.lstrip())
        key, _, rest = stripped.partition(":")
        is_leaf = bool(rest.strip())
        if indent <= 2 and is_leaf:
            above = lines[i - 1].strip()
            assert above.startswith("#"), f"values.yaml: {key!r} has no comment"


def test_grafana_dashboard_covers_the_paper_metrics(helm: Path) -> None:
    docs = template(helm, CASES["observability"])
    cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")
    )
    dashboard = json.loads(cm["data"]["flowprefill.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for metric in (
        "flowprefill_gateway_ttft_seconds_bucket",
        "flowprefill_gateway_slo_requests_total",
        "flowprefill_prefill_preemptions_total",
        "flowprefill_prefill_queue_depth",
    ):
        assert metric in exprs
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def _operator_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]
    return pod["spec"]


# ------------------------------------------------------ images and operator settings


def _env(docs: list[dict[str, Any]]) -> dict[str, str]:
    container = _operator_pod(docs)["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _settings(docs: list[dict[str, Any]]) -> Any:
    from flowprefill_operator.settings import ENV_PREFIX, OperatorSettings

    env = _env(docs)
    for name in env:  # every variable the chart sets is one the operator reads
        if name.startswith(ENV_PREFIX):
            assert name[len(ENV_PREFIX) :].lower() in OperatorSettings.model_fields, name
    return OperatorSettings.from_env(env)


def _images(docs: list[dict[str, Any]]) -> dict[str, str]:
    settings = _settings(docs)
    return {
        "operator": _operator_pod(docs)["containers"][0]["image"],
        "prefill": settings.prefill_image,
        "decode": settings.decode_image,
        "gateway": settings.gateway_image,
    }


def test_images_follow_one_registry_and_tag(helm: Path) -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    names = ("operator", "prefill", "decode", "gateway")
    default = _images(template(helm, []))
    assert default == {n: f"ghcr.io/flowprefill/{n}:{app_version}" for n in names}

    moved = ["--set", "image.registry=registry.example.com:5000/ml/", "--set", "image.tag=v2"]
    assert _images(template(helm, moved)) == {
        n: f"registry.example.com:5000/ml/{n}:v2" for n in names
    }
    # Per-image overrides win for that image alone; the operator's digest pins it.
    digest = "sha256:" + "c" * 64
    overrides = [
        *moved,
        "--set", "children.decodeImage=vllm.example/decode@" + digest,
        "--set", "image.repository=mirror.example/flowprefill-operator",
        "--set", "image.digest=" + digest,
    ]  # fmt: skip
    one_off = _images(template(helm, overrides))
    assert one_off == {
        "operator": "mirror.example/flowprefill-operator@" + digest,
        "prefill": "registry.example.com:5000/ml/prefill:v2",
        "decode": "vllm.example/decode@" + digest,
        "gateway": "registry.example.com:5000/ml/gateway:v2",
    }


def test_children_pull_secrets_default_to_the_charts(helm: Path, tmp_path: Path) -> None:
    def secrets(*args: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the operator pod's own pull secrets, the ones it puts on children)."""
        docs = template(helm, list(args))
        own = tuple(s["name"] for s in _operator_pod(docs).get("imagePullSecrets", []))
        return own, tuple(_settings(docs).child_image_pull_secrets)

    assert secrets() == ((), ())
    chart = ["--set", "imagePullSecrets[0].name=regcred", "--set", "imagePullSecrets[1].name=b"]
    assert secrets(*chart) == (("regcred", "b"), ("regcred", "b"))
    child = ["--set", "children.imagePullSecrets[0].name=child"]
    assert secrets(*chart, *child) == (("regcred", "b"), ("child",))
    none = tmp_path / "none.yaml"  # [] (not null): the children get none
    none.write_text("children:\n  imagePullSecrets: []\n")
    assert secrets(*chart, "-f", str(none)) == (("regcred", "b"), ())


def test_model_source_settings(helm: Path) -> None:
    default = _settings(template(helm, []))
    assert default.model_check is True and default.hf_endpoint is None
    assert "FLOWPREFILL_OPERATOR_HF_ENDPOINT" not in _env(template(helm, []))
    mirror = "https://hf-mirror.example.com"
    set_ = _settings(
        template(
            helm,
            ["--set", "modelSources.check=false", "--set", f"modelSources.hfEndpoint={mirror}"],
        )
    )
    assert set_.model_check is False and set_.hf_endpoint == mirror


def test_new_values_are_checked(helm: Path) -> None:
    for bad in (
        "modelSources.imageVolumes=sometimes",
        "modelSources.hfEndpoint=hf-mirror.example.com",  # no scheme
        "modelSources.hubCIDRs={0.0.0.0}",
        "image.registry=",
        "image.tag=a:b",
        "children.imagePullSecrets[0].nam=x",
    ):
        refused = run(helm, "template", "fp", str(CHART), "--set", bad)
        assert refused.returncode != 0, bad


def test_notes_say_no_images_are_published(helm: Path) -> None:
    out = run(
        helm, "install", "fp", str(CHART), "-n", "flowprefill-system", "--dry-run=client",
        "--set", "image.registry=registry.example.com/ml",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "No public FlowPrefill images are published" in notes
    assert "docs/images.md" in notes
    assert "registry.example.com/ml/prefill:" in notes
