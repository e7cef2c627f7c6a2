"""The chart's NetworkPolicies and namespaced RBAC, rendered by the real helm binary.

Pods are the ones the operator's builders make from examples/llama3-8b.yaml (their labels
and ports), so a label or port that drifts between the builders, the contracts and the
chart fails here. Who may reach whom is evaluated with NetworkPolicy semantics
(tests/operator/chart.py), both directions (the operator's egress, the pods' ingress).
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from flowprefill_operator import MANAGED_BY
from flowprefill_operator.builders import (
    PoolRef,
    SLOClassView,
    build_gateway_children,
    build_pool_children,
    build_slo_table,
    judge_classes,
)
from flowprefill_operator.builders.common import ROLE_LABEL
from flowprefill_operator.models import ServingPoolSpec, SLOClassSpec
from flowprefill_operator.settings import OperatorSettings

from flowprefill.contracts.deployment import (
    COLOCATED_HEALTH_PORT,
    DECODE_PORT,
    GATEWAY_PORT,
    PREFILL_KV_PORT,
    PREFILL_PORT,
)
from tests.operator.chart import (
    CHART,
    RELEASE_NAMESPACE,
    Manifest,
    Pod,
    allowed,
    is_hook,
    render,
    selects,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama3-8b.yaml"
PORTS = {"gateway": GATEWAY_PORT, "prefill": PREFILL_PORT, "decode": DECODE_PORT}
NAMESPACED = ["--set", "watch.scope=namespaced", "--set", "watch.namespaces={team-a,team-b}"]
CLUSTER = ["--set", "watch.scope=cluster"]  # opt-in: the default is namespaced


def policies(*args: str) -> list[Manifest]:
    return [d for d in render(*args) if d["kind"] == "NetworkPolicy"]


def example_children(namespace: str) -> list[Manifest]:
    """What the operator creates in ``namespace`` for the example's two pools."""
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d["kind"] == "ServingPool"]
    pools = [
        PoolRef(
            d["metadata"]["name"], namespace, f"uid-{i}", ServingPoolSpec.model_validate(d["spec"])
        )
        for i, d in enumerate(docs)
    ]
    classes = [SLOClassView("chat", {}, "t0", 1, SLOClassSpec(task_type="text", ttft_slo_ms=250))]
    table = build_slo_table(classes, [None], judge_classes(classes, {}), {})
    settings = OperatorSettings()
    return [
        *(m for p in pools for m in build_pool_children(p, settings)),
        *build_gateway_children(pools, table, settings),
    ]


def container_ports(namespace: str) -> dict[str, dict[str, int]]:
    """role -> {port name: container port}, as the builders make the example's pods."""
    out = {}
    for dep in (m for m in example_children(namespace) if m["kind"] == "Deployment"):
        template = dep["spec"]["template"]
        role = template["metadata"]["labels"][ROLE_LABEL]
        out[role] = {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
                     for p in c["ports"]}  # fmt: skip
    return out


def pods(namespace: str) -> dict[str, tuple[Pod, int]]:
    """role -> (a pod of that role as the builders label it, its API port)."""
    out = {}
    ports = container_ports(namespace)
    for dep in (m for m in example_children(namespace) if m["kind"] == "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        role = labels[ROLE_LABEL]
        out[role] = (Pod(namespace, dict(labels)), ports[role]["http"])
    assert set(out) == {"gateway", "prefill", "decode"}
    return out


def operator_pod(docs: list[Manifest]) -> Pod:
    dep = next(d for d in docs if d["kind"] == "Deployment")
    return Pod(RELEASE_NAMESPACE, dict(dep["spec"]["template"]["metadata"]["labels"]))


PROMETHEUS = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"}, ip="10.244.9.9")
CLIENT = Pod("apps", {"app": "chat-frontend"}, ip="10.244.7.7")
API_SERVER = Pod("default", {"component": "apiserver"}, ip="10.96.0.1")
HUB = Pod("internet", {}, ip="18.160.1.2")  # outside the cluster: matched by ipBlock alone


def test_ports_and_labels_agree_with_the_contracts_and_builders() -> None:
    nps = {p["metadata"]["name"].rsplit("-", 1)[1]: p for p in policies(*NAMESPACED)}
    named = container_ports("team-a")
    # The example's pools hand KV off over http: prefill pods listen for decode on a port
    # of their own, the contracts' (the builders and the chart both use it).
    assert named["prefill"] == {"http": PREFILL_PORT, "kv": PREFILL_KV_PORT}
    for role, (pod, container_port) in pods("team-a").items():
        assert container_port == PORTS[role]  # builders use the contracts' ports
        selecting = [n for n, p in nps.items() if selects(p["spec"]["podSelector"], pod.labels)]
        assert selecting == [role], f"{role} pods are selected by {selecting}"
        # Rules without a port (nixl: every TCP port between prefill and decode) aside.
        ingress_ports = {pt["port"] for r in nps[role]["spec"]["ingress"] for pt in r["ports"]
                         if "port" in pt}  # fmt: skip
        assert ingress_ports == set(named[role].values()), role
    selector = nps["gateway"]["spec"]["podSelector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/managed-by": MANAGED_BY, ROLE_LABEL: "gateway"}


def test_who_may_reach_whom_in_namespaced_mode() -> None:
    docs = render(*NAMESPACED)
    nps = [d for d in docs if d["kind"] == "NetworkPolicy"]
    a, b = pods("team-a"), pods("team-b")
    gw, gw_port = a["gateway"]
    prefill, prefill_port = a["prefill"]
    decode, decode_port = a["decode"]
    operator = operator_pod(docs)
    stranger = Pod("team-a", {"app": "something-else"})

    def ok(src: Pod, dst: Pod, port: int) -> bool:
        return allowed(nps, src, dst, port)

    kv_port = container_ports("team-a")["prefill"]["kv"]
    # The request path: the gateway calls prefill's API port (/v1/prefill, and DELETE
    # /v1/kv/<id> of hand-offs decode will not load) and decode.
    assert ok(CLIENT, gw, gw_port)
    assert ok(gw, prefill, prefill_port) and ok(gw, decode, decode_port)
    # KV hand-offs (prompt-derived data) are read on prefill's KV port, by decode alone:
    # not even the gateway reaches it.
    assert ok(decode, prefill, kv_port)
    assert not ok(gw, prefill, kv_port)
    # The nixl transport (networkPolicy.kvOverNixl, on by default: GPU pools default to
    # it): UCX connects on ephemeral ports both ways, so prefill and decode reach each
    # other on every TCP port (test_operator_nixl.py) ...
    assert ok(decode, prefill, prefill_port) and ok(prefill, decode, decode_port)
    # ... and without it decode, which only pulls (and deletes what it loaded) on the KV
    # port, reaches neither prefill's API port nor prefill decode's.
    http_only = policies(*NAMESPACED, "--set", "networkPolicy.kvOverNixl=false")
    assert allowed(http_only, decode, prefill, kv_port)
    assert not allowed(http_only, decode, prefill, prefill_port)
    assert not allowed(http_only, prefill, decode, decode_port)
    # Nobody else reaches prefill or decode.
    for src in (CLIENT, stranger, operator, PROMETHEUS, b["gateway"][0], b["decode"][0]):
        assert not ok(src, prefill, kv_port), src
        if src is not PROMETHEUS:
            assert not ok(src, prefill, prefill_port), src
            assert not ok(src, decode, decode_port), src
    # Metrics: Prometheus everywhere, the operator at the gateways (and only there).
    for dst, port in (a["gateway"], a["prefill"], a["decode"]):
        assert ok(PROMETHEUS, dst, port)
    assert ok(operator, gw, gw_port) and ok(operator, b["gateway"][0], gw_port)
    # The operator's own egress: the API server, DNS, watched namespaces' gateways only.
    assert ok(operator, API_SERVER, 443) and ok(operator, API_SERVER, 6443)
    assert ok(operator, Pod("kube-system", {"k8s-app": "kube-dns"}), 53)
    assert not ok(operator, API_SERVER, 80)
    assert not ok(operator, Pod("team-c", dict(gw.labels)), gw_port)
    # And its ingress: the probe port only.
    probe = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    probe_port = probe["containers"][0]["ports"][0]["containerPort"]
    assert ok(CLIENT, operator, probe_port) and not ok(CLIENT, operator, 9999)


def colocated_pod(namespace: str) -> tuple[Pod, dict[str, int]]:
    """A colocated pool's pod as the builders label it, and its container ports by name."""
    spec = ServingPoolSpec.model_validate(
        {"service": "m", "role": "colocated", "model": {"path": "/models/m"},
         "kvHandoff": {"transport": "http"}}
    )  # fmt: skip
    children = build_pool_children(PoolRef("m-colo", namespace, "uid-c", spec), OperatorSettings())
    (dep,) = (m for m in children if m["kind"] == "Deployment")
    template = dep["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return Pod(namespace, dict(template["metadata"]["labels"])), ports


def test_colocated_pods_take_what_prefill_and_decode_pods_take() -> None:
    nps = policies(*NAMESPACED)
    a = pods("team-a")
    colo, ports = colocated_pod("team-a")
    assert ports == {"http": PREFILL_PORT, "decode": DECODE_PORT, "kv": PREFILL_KV_PORT,
                     "health": COLOCATED_HEALTH_PORT}  # fmt: skip
    selecting = [p["metadata"]["name"] for p in nps if p["metadata"]["namespace"] == "team-a"
                 and selects(p["spec"]["podSelector"], colo.labels)]  # fmt: skip
    assert selecting == ["fp-flowprefill-colocated"]
    gw, prefill, decode = a["gateway"][0], a["prefill"][0], a["decode"][0]
    stranger = Pod("team-a", {"app": "something-else"})

    def ok(src: Pod, dst: Pod, port: int, docs: list[Manifest] = nps) -> bool:
        return allowed(docs, src, dst, port)

    # The gateway calls both of its APIs; nobody else does.
    assert ok(gw, colo, PREFILL_PORT) and ok(gw, colo, DECODE_PORT)
    for src in (CLIENT, stranger, pods("team-b")["gateway"][0]):
        assert not ok(src, colo, PREFILL_PORT) and not ok(src, colo, DECODE_PORT), src
    # Hand-offs over http: its decode pulls from prefill pods and other colocated pods;
    # decode pods pull from it; the gateway never reaches a KV port.
    other_colo = Pod("team-a", dict(colo.labels))
    assert ok(colo, prefill, PREFILL_KV_PORT) and ok(other_colo, colo, PREFILL_KV_PORT)
    assert ok(decode, colo, PREFILL_KV_PORT) and not ok(gw, colo, PREFILL_KV_PORT)
    # nixl: every TCP port both ways with prefill and decode pods, and between colocated.
    for peer in (prefill, decode, other_colo):
        assert ok(peer, colo, 5600) and ok(colo, peer, 5700), peer
    http_only = policies(*NAMESPACED, "--set", "networkPolicy.kvOverNixl=false")
    assert not ok(decode, colo, 5600, http_only) and not ok(colo, decode, 5700, http_only)
    # The kubelet probes the launcher (status only); Prometheus scrapes both processes.
    assert ok(stranger, colo, COLOCATED_HEALTH_PORT)
    assert ok(PROMETHEUS, colo, PREFILL_PORT) and ok(PROMETHEUS, colo, DECODE_PORT)
    assert not ok(stranger, colo, 5600)


def test_policies_exist_in_every_watched_namespace_and_validate() -> None:
    nps = policies(*NAMESPACED)
    where = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in nps}
    for ns in ("team-a", "team-b"):
        for role in [*PORTS, "colocated"]:
            assert (ns, f"fp-flowprefill-{role}") in where
    assert (RELEASE_NAMESPACE, "fp-flowprefill-operator") in where
    assert len(nps) == 9  # four per watched namespace (gateway, prefill, decode, colocated)
    for p in nps:
        kubernetes_validate.validate(p, "1.33", strict=True)


def test_cluster_scope_puts_policies_where_told() -> None:
    default = policies(*CLUSTER)
    assert {p["metadata"]["namespace"] for p in default} == {RELEASE_NAMESPACE}
    listed = policies(*CLUSTER, "--set", "networkPolicy.namespaces={serving,batch}")
    assert {p["metadata"]["namespace"] for p in listed} == {"serving", "batch", RELEASE_NAMESPACE}
    operator = next(p for p in listed if p["metadata"]["name"].endswith("-operator"))
    assert operator["metadata"]["namespace"] == RELEASE_NAMESPACE
    gw, port = pods("anywhere")["gateway"]
    cluster_operator = operator_pod(render(*CLUSTER))
    assert allowed(listed, cluster_operator, gw, port)  # cluster scope: any namespace


def test_values_tighten_the_defaults() -> None:
    args = [
        *NAMESPACED,
        "--set", "networkPolicy.gatewayFrom[0].ipBlock.cidr=10.244.7.0/24",
        "--set", "networkPolicy.kvOverHttp=false",
        "--set", "networkPolicy.kvOverNixl=false",
        "--set", "networkPolicy.metricsFrom=null",
        "--set", "networkPolicy.apiServerCIDRs={10.96.0.1/32}",
        "--set", "networkPolicy.apiServerPorts={443}",
        "--set", "modelSources.hubCIDRs={18.160.0.0/16}",
    ]  # fmt: skip
    docs = render(*args)
    nps = [d for d in docs if d["kind"] == "NetworkPolicy"]
    a = pods("team-a")
    gw, gw_port = a["gateway"]
    prefill, prefill_port = a["prefill"]
    kv_port = container_ports("team-a")["prefill"]["kv"]
    operator = operator_pod(docs)
    assert allowed(nps, CLIENT, gw, gw_port)  # inside the CIDR
    assert not allowed(nps, Pod("apps", {}, ip="10.1.0.5"), gw, gw_port)
    assert allowed(nps, operator, gw, gw_port)  # the operator still scrapes
    # No KV over http or nixl: decode reaches no prefill port.
    for port in (kv_port, prefill_port):
        assert not allowed(nps, a["decode"][0], prefill, port)
    assert not allowed(nps, gw, prefill, kv_port)
    assert allowed(nps, gw, prefill, prefill_port)
    assert not allowed(nps, PROMETHEUS, prefill, prefill_port)
    assert allowed(nps, operator, API_SERVER, 443)
    assert not allowed(nps, operator, API_SERVER, 6443)
    assert not allowed(nps, operator, Pod("default", {}, ip="192.168.1.1"), 443)
    assert allowed(nps, operator, HUB, 443) and not allowed(nps, operator, HUB, 80)
    for p in nps:
        kubernetes_validate.validate(p, "1.33", strict=True)


@pytest.mark.parametrize(
    ("args", "hub_port"),
    [
        ([], 443),
        (["--set", "modelSources.check=false"], None),
        (["--set", "modelSources.hfEndpoint=https://hf-mirror.example.com"], 443),
        (["--set", "modelSources.hfEndpoint=http://hf-mirror.internal:8080/hub"], 8080),
        (["--set", "modelSources.hfEndpoint=http://hf-mirror.internal"], 80),
    ],
)
def test_the_operator_reaches_the_hub_only_to_check_models(
    args: list[str], hub_port: int | None
) -> None:
    """modelSources.check: the operator asks the Hub (or hfEndpoint) about hf:// sources
    before creating pods; its egress opens that port and no other. The API server's CIDR
    is pinned so that its 443 rule does not let the Hub through on its own."""
    pinned = ["--set", "networkPolicy.apiServerCIDRs={10.96.0.1/32}"]
    docs = render(*pinned, *args)
    nps = [d for d in docs if d["kind"] == "NetworkPolicy"]
    operator = operator_pod(docs)
    for port in (443, 80, 8080, 22):
        assert allowed(nps, operator, HUB, port) == (port == hub_port), port
    assert allowed(nps, operator, API_SERVER, 443)
    for p in nps:
        kubernetes_validate.validate(p, "1.33", strict=True)
    if hub_port is not None:  # hubCIDRs narrows the destination
        narrowed = render(*pinned, *args, "--set", "modelSources.hubCIDRs={18.160.0.0/16}")
        nps = [d for d in narrowed if d["kind"] == "NetworkPolicy"]
        assert allowed(nps, operator, HUB, hub_port)
        assert not allowed(nps, operator, Pod("x", {}, ip="104.16.0.1"), hub_port)


def test_disabling_renders_no_policy() -> None:
    for mode in ([], NAMESPACED, CLUSTER):
        assert policies(*mode, "--set", "networkPolicy.enabled=false") == []
        assert policies(*mode)  # on by default


# ------------------------------------------------------------------------------ RBAC

EVERYTHING = [
    "--set", "serviceMonitor.enabled=true",
    "--set", "grafanaDashboard.enabled=true",
    "--set", "prometheusRule.enabled=true",
]  # fmt: skip
# mode -> (helm arguments, the namespaces the operator watches)
NAMESPACED_MODES: dict[str, tuple[list[str], set[str]]] = {
    "namespaced": (NAMESPACED, {"team-a", "team-b"}),
    "namespaced-release-only": (["--set", "watch.scope=namespaced"], {RELEASE_NAMESPACE}),
    "default": ([], {RELEASE_NAMESPACE}),  # namespaced is the default
    # An installer with no cluster-wide rights: the CRDs applied by an admin, no user roles.
    "namespaced-no-cluster-objects": (
        [*NAMESPACED, "--set", "crds.enabled=false", "--set", "rbac.aggregateToUserRoles=false"],
        {"team-a", "team-b"},
    ),
    "namespaced-ha-everything": (
        [*NAMESPACED, "--set", "replicaCount=2", "--set", "peering.enabled=true", *EVERYTHING],
        {"team-a", "team-b"},
    ),
    "namespaced-kube-1.30": ([*NAMESPACED, "--kube-version", "1.30.0"], {"team-a", "team-b"}),
}
# Cluster-scoped objects a namespaced install may render: the ImageVolume admission gate
# below Kubernetes 1.35 (it grants nothing; its binding matches only the watched namespaces).
GRANT_FREE = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
# ... and, unless turned off, the CRDs (crds.enabled) and the users' aggregated roles
# (rbac.aggregateToUserRoles), which grant only flowprefill.io and bind to nobody here.
AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


@pytest.mark.parametrize("mode", NAMESPACED_MODES)
def test_namespaced_mode_grants_nothing_cluster_wide(mode: str) -> None:
    args, watched = NAMESPACED_MODES[mode]
    docs = render(*args)
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ClusterRoleBinding", "ClusterKopfPeering"}, kinds
    if "crds.enabled=false" in args:
        assert not kinds & {"ClusterRole", "CustomResourceDefinition"}, kinds
    for doc in docs:  # nothing cluster-scoped but the admission gate, which binds only the
        # watched namespaces, the CRDs, and the users' roles, aggregated and unbound
        if doc["kind"] == "CustomResourceDefinition":
            assert doc["spec"]["group"] == "flowprefill.io"
            continue
        if doc["kind"] == "ClusterRole":
            assert any(k.startswith(AGGREGATE) for k in doc["metadata"]["labels"]), doc
            assert all(r["apiGroups"] == ["flowprefill.io"] for r in doc["rules"]), doc
            continue
        if doc["kind"] in GRANT_FREE:
            selector = doc["spec"].get("matchResources", {}).get("namespaceSelector")
            if doc["kind"] == "ValidatingAdmissionPolicyBinding":
                (expr,) = selector["matchExpressions"]
                assert set(expr["values"]) == watched and expr["operator"] == "In"
            continue
        assert doc["metadata"].get("namespace"), f"{doc['kind']} {doc['metadata']['name']}"
    if "--kube-version" in args:
        assert kinds >= GRANT_FREE
    # The operator's (the uninstall hook's own Role: test_chart_lifecycle.py).
    roles = [d for d in docs if d["kind"] == "Role" and not is_hook(d)]
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and not is_hook(d)]
    assert {r["metadata"]["namespace"] for r in roles} == watched
    assert {b["metadata"]["namespace"] for b in bindings} == watched
    for rule in (r for role in roles for r in role["rules"]):
        # Only namespaced resources: a Role cannot grant cluster-scoped ones anyway, and
        # kopf falls back without them (docs/operator.md, "Network policies and RBAC").
        assert not {"customresourcedefinitions", "namespaces", "clusterkopfpeerings"} & set(
            rule["resources"]
        ), rule
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "fp-flowprefill", "namespace": RELEASE_NAMESPACE}
        ]


def test_cluster_mode_is_where_the_cluster_role_lives() -> None:
    docs = render(*CLUSTER)
    operator_roles = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "fp-flowprefill"
    ]
    (role,) = operator_roles
    crd_rule = [r for r in role["rules"] if "customresourcedefinitions" in r["resources"]]
    assert crd_rule and set(crd_rule[0]["verbs"]) == {"get", "list", "watch"}
    assert {d["kind"] for d in docs} >= {"ClusterRoleBinding"}


def test_chart_ports_are_the_contracts(repo_root: Path) -> None:
    """The chart spells the ports once, in _helpers.tpl; they must be the contracts'."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    for name, port in (
        ("gatewayPort", GATEWAY_PORT),
        ("prefillPort", PREFILL_PORT),
        ("decodePort", DECODE_PORT),
        ("prefillKvPort", PREFILL_KV_PORT),
        ("colocatedHealthPort", COLOCATED_HEALTH_PORT),
    ):
        assert f'define "flowprefill.{name}" -}}}}{port}{{{{' in helpers, name
    assert (repo_root / "charts" / "flowprefill") == CHART
