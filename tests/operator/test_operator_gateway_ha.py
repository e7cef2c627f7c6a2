"""The gateway is not a single point of failure (issue 22 item 6): per-service replicas, a
PodDisruptionBudget above one pod, preferred anti-affinity by node, an optional HPA, an
optional Gateway API HTTPRoute; and gateway names no pool can take (item 4).

Core kinds are validated with kubernetes_validate's strict schemas. The HTTPRoute has no
schema there: :data:`HTTPROUTE_SCHEMA` transcribes the parts of Gateway API v1's
``HTTPRoute`` the operator writes (ParentReference, HTTPRouteRule, HTTPBackendRef; their
required fields, bounds and patterns), unknown fields refused.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from flowprefill_operator.builders import PoolRef, build_gateway_children, gateway_name
from flowprefill_operator.builders.gateway_ha import HOSTNAME_TOPOLOGY
from flowprefill_operator.models import ServingPoolSpec, SLOTable
from flowprefill_operator.models.gateway import (
    ESCAPED_NAME_TOO_LONG,
    GATEWAY_SUFFIX,
    MAX_ESCAPED_NAME,
    MIN_ABOVE_MAX,
    pool_name_problem,
    pool_workload_name,
)
from flowprefill_operator.settings import OperatorSettings
from pydantic import ValidationError

from tests.operator.cluster import Cluster, create, pool
from tests.operator.crdcheck import validate_cr
from tests.operator.harness import wait_for

SETTINGS = OperatorSettings()
TABLE = SLOTable(default_class=None, classes=[])

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_HOST = {
    "type": "string",
    "maxLength": 253,
    "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}


def _strict(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


HTTPROUTE_SCHEMA = _strict(
    {
        "apiVersion": {"enum": ["gateway.networking.k8s.io/v1"]},
        "kind": {"enum": ["HTTPRoute"]},
        "metadata": {"type": "object"},
        "spec": _strict(
            {
                "parentRefs": {
                    "type": "array",
                    "maxItems": 32,
                    "items": _strict(
                        {
                            "group": {"type": "string", "maxLength": 253},
                            "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                            "namespace": {"type": "string", "minLength": 1, "maxLength": 63},
                            "name": _NAME,
                            "sectionName": {"type": "string", "minLength": 1, "maxLength": 253},
                            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        },
                        ["name"],
                    ),
                },
                "hostnames": {"type": "array", "maxItems": 16, "items": _HOST},
                "rules": {
                    "type": "array",
                    "maxItems": 16,
                    "items": _strict(
                        {
                            "matches": {
                                "type": "array",
                                "maxItems": 64,
                                "items": _strict(
                                    {
                                        "path": _strict(
                                            {
                                                "type": {
                                                    "enum": [
                                                        "Exact",
                                                        "PathPrefix",
                                                        "RegularExpression",
                                                    ]
                                                },
                                                "value": {"type": "string", "maxLength": 1024},
                                            },
                                            [],
                                        )
                                    },
                                    [],
                                ),
                            },
                            "backendRefs": {
                                "type": "array",
                                "maxItems": 16,
                                "items": _strict(
                                    {
                                        "name": _NAME,
                                        "port": {
                                            "type": "integer",
                                            "minimum": 1,
                                            "maximum": 65535,
                                        },
                                    },
                                    ["name"],
                                ),
                            },
                        },
                        [],
                    ),
                },
            },
            [],
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)


def _pool(name: str = "m-prefill", role: str = "prefill", **spec: Any) -> PoolRef:
    raw = {"service": "m", "role": role, "model": {"path": "/models/m"}, **spec}
    return PoolRef(name, "ns", "uid-" + name, ServingPoolSpec.model_validate(raw))


def _children(*pools: PoolRef, settings: OperatorSettings = SETTINGS) -> dict[str, Any]:
    return {m["kind"]: m for m in build_gateway_children(list(pools), TABLE, settings)}


def _validate(children: dict[str, Any]) -> None:
    for kind, manifest in children.items():
        if kind == "HTTPRoute":
            jsonschema.Draft7Validator(HTTPROUTE_SCHEMA).validate(manifest)
        else:
            for version in ("1.33", "1.37"):
                kubernetes_validate.validate(manifest, version, strict=True)


def test_one_gateway_pod_by_default_spread_by_node_and_no_budget_to_block_drains() -> None:
    children = _children(_pool())
    assert set(children) == {"ConfigMap", "Deployment", "Service"}  # one of each kind shown
    dep = children["Deployment"]
    assert dep["spec"]["replicas"] == 1
    # One pod: a PDB with maxUnavailable 1 protects nothing, minAvailable 1 blocks drains.
    term = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ][0]["podAffinityTerm"]
    assert term["topologyKey"] == HOSTNAME_TOPOLOGY
    assert term["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    # The gateway needs no GPU to surge: never below the pods asked for.
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    _validate(children)


def test_per_service_replicas_bring_a_disruption_budget() -> None:
    children = _children(_pool(gateway={"replicas": 3}))
    dep, pdb = children["Deployment"], children["PodDisruptionBudget"]
    assert dep["spec"]["replicas"] == 3
    assert pdb["metadata"]["name"] == gateway_name("m")
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]},
    }
    # The budget selects exactly the gateway's pods.
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["metadata"]["ownerReferences"] == dep["metadata"]["ownerReferences"]
    _validate(children)
    # The operator-wide default (the chart's gateway.replicas) applies to every service.
    wide = _children(_pool(), settings=OperatorSettings(gateway_replicas=2))
    assert wide["Deployment"]["spec"]["replicas"] == 2 and "PodDisruptionBudget" in wide


def test_the_gateway_settings_come_from_the_tokenizer_pool_only() -> None:
    prefill = _pool("m-prefill", gateway={"replicas": 2})
    decode = _pool("m-decode", "decode", gateway={"replicas": 5}, resources={"gpusPerPod": 1})
    assert _children(prefill, decode)["Deployment"]["spec"]["replicas"] == 2


def test_an_hpa_owns_the_gateway_replicas() -> None:
    auto = {"minReplicas": 2, "maxReplicas": 6, "targetCpuUtilizationPercent": 60}
    children = _children(_pool(gateway={"autoscaling": auto}))
    dep, hpa = children["Deployment"], children["HorizontalPodAutoscaler"]
    assert "replicas" not in dep["spec"]  # the HPA's to write
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": dep["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    target = hpa["spec"]["metrics"][0]["resource"]
    assert target == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}
    # CPU utilisation is relative to the request: the container must have one.
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    assert "PodDisruptionBudget" in children  # never below two pods
    _validate(children)
    single = _children(_pool(gateway={"autoscaling": {**auto, "minReplicas": 1}}))
    assert "PodDisruptionBudget" not in single


def test_hpa_bounds_are_checked(crd_schemas: Any) -> None:
    spec = {
        "service": "m",
        "role": "prefill",
        "model": {"path": "/m"},
        "gateway": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
    }
    with pytest.raises(ValidationError):
        ServingPoolSpec.model_validate(spec)
    obj = {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "m-prefill", "namespace": "ns"},
        "spec": spec,
    }
    assert any(MIN_ABOVE_MAX in e for e in validate_cr(obj, crd_schemas))


PARENT = {"name": "public", "namespace": "gateways", "sectionName": "https"}


def test_an_http_route_from_the_chart_default_reaches_the_gateway_service() -> None:
    settings = OperatorSettings.from_env(
        {"FLOWPREFILL_OPERATOR_GATEWAY_ROUTE_PARENT_REFS": '[{"name": "public", '
         '"namespace": "gateways", "sectionName": "https"}]'}
    )  # fmt: skip
    children = _children(_pool(), settings=settings)
    route, svc = children["HTTPRoute"], children["Service"]
    assert route["spec"]["parentRefs"] == [PARENT]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert backend == {"name": svc["metadata"]["name"], "port": svc["spec"]["ports"][0]["port"]}
    assert route["spec"]["rules"][0]["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    _validate(children)
    # No parent anywhere: no route (the operator cannot guess the user's Gateway).
    assert "HTTPRoute" not in _children(_pool())
    # A pool may turn the default off.
    off = _pool(gateway={"httpRoute": {"enabled": False}})
    assert "HTTPRoute" not in _children(off, settings=settings)


def test_an_http_route_from_the_pool_with_its_hostnames() -> None:
    route_spec = {"parentRefs": [{"name": "internal"}], "hostnames": ["llm.example.com"]}
    children = _children(_pool(gateway={"httpRoute": route_spec}))
    route = children["HTTPRoute"]["spec"]
    assert route["parentRefs"] == [{"name": "internal"}]
    assert route["hostnames"] == ["llm.example.com"]
    _validate(children)


def test_a_gatewaypod_affinity_replaces_the_default_spread() -> None:
    required = {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"a": "b"}}, "topologyKey": "zone"}
        ]
    }
    pool = _pool(gatewayPod={"affinity": {"podAntiAffinity": copy.deepcopy(required)}})
    affinity = _children(pool)["Deployment"]["spec"]["template"]["spec"]["affinity"]
    assert affinity == {"podAntiAffinity": required}


def _pool_cr(name: str, service: str) -> dict[str, Any]:
    return {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"service": service, "role": "prefill", "model": {"path": "/m"}},
    }


def test_no_two_children_of_any_services_share_a_name() -> None:
    # Pool a-gateway of service b would name its Deployment and Service a-gateway: the
    # names of service a's gateway. Such pools get an escape suffix, itself escaped.
    assert gateway_name("a") == "a" + GATEWAY_SUFFIX
    pools = ["a", "a-gateway", "a-gateway-pool", "a-gateway-pool-pool", "a-pool", "gateway"]
    services = ["a", "a-gateway", "a-gateway-pool", "b"]
    names = [pool_workload_name(p) for p in pools] + [gateway_name(s) for s in services]
    assert len(set(names)) == len(names)
    assert pool_workload_name("a-gateway") == "a-gateway-pool"
    # Every other name, all of them in practice, is unchanged.
    for unchanged in ("a", "a-pool", "gateway", "a-gateway-prefill", "m-decode"):
        assert pool_workload_name(unchanged) == unchanged


def test_an_escaped_pool_name_must_leave_room_for_its_suffix(crd_schemas: Any) -> None:
    longest = "g" * (MAX_ESCAPED_NAME - len(GATEWAY_SUFFIX)) + GATEWAY_SUFFIX
    assert validate_cr(_pool_cr(longest, "b"), crd_schemas) == []
    assert len(pool_workload_name(longest)) == 63  # a DNS-1035 label's limit
    refused = validate_cr(_pool_cr("g" + longest, "b"), crd_schemas)
    assert refused and all(ESCAPED_NAME_TOO_LONG in e for e in refused)
    assert pool_name_problem("g" + longest) == ESCAPED_NAME_TOO_LONG
    # Unescaped names keep the DNS label limit alone.
    assert validate_cr(_pool_cr("p" * 63, "b"), crd_schemas) == []
    assert pool_name_problem("p" * 63) is None


# ---- against the emulator ------------------------------------------------------------


def test_the_budget_hpa_and_route_follow_the_pool_on_a_cluster(
    cluster: Cluster,
) -> None:
    ns = "gateway-ha"
    create(cluster, pool("m-prefill", "m", gateway={"replicas": 2}), ns)
    pdb = wait_for(lambda: cluster.get("PodDisruptionBudget", ns, "m-gateway"), what="PDB")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert cluster.get("Deployment", ns, "m-gateway")["spec"]["replicas"] == 2
    # An HPA takes over the count: turning it on does not drop the gateway to one pod,
    # and the count it writes is kept.
    auto = {"minReplicas": 2, "maxReplicas": 4}
    cluster.kube.patch("ServingPool", ns, "m-prefill", {"spec": {"gateway": {"autoscaling": auto}}})
    wait_for(lambda: cluster.kube.get("HorizontalPodAutoscaler", ns, "m-gateway"), what="HPA")
    time.sleep(2)
    # Still written (a removed field is reset to 1 by the API server's defaulting).
    assert cluster.get("Deployment", ns, "m-gateway")["spec"].get("replicas") == 2
    cluster.kube.patch("Deployment", ns, "m-gateway", {"spec": {"replicas": 3}})  # as the HPA
    time.sleep(3)  # several reconciles (1 s timers)
    assert cluster.get("Deployment", ns, "m-gateway")["spec"]["replicas"] == 3
    cluster.kube.patch("ServingPool", ns, "m-prefill", {"spec": {"gateway": {"autoscaling": None}}})
    wait_for(
        lambda: cluster.kube.get("HorizontalPodAutoscaler", ns, "m-gateway") is None,
        what="HPA gone",
    )
    wait_for(lambda: cluster.get("Deployment", ns, "m-gateway")["spec"]["replicas"] == 2)
    # Back to one pod: the budget would block every node drain, so it goes.
    cluster.kube.patch("ServingPool", ns, "m-prefill", {"spec": {"gateway": {"replicas": 1}}})
    wait_for(
        lambda: cluster.kube.get("PodDisruptionBudget", ns, "m-gateway") is None, what="PDB gone"
    )
    # A route (the emulator serves HTTPRoutes as a cluster with the Gateway API does),
    # and none once the pool turns it off.
    route = {"httpRoute": {"parentRefs": [{"name": "public", "namespace": "gateways"}]}}
    cluster.kube.patch("ServingPool", ns, "m-prefill", {"spec": {"gateway": route}})
    applied = wait_for(lambda: cluster.get("HTTPRoute", ns, "m-gateway"), what="route")
    assert applied["spec"]["parentRefs"] == route["httpRoute"]["parentRefs"]
    assert applied["spec"]["rules"][0]["backendRefs"] == [{"name": "m-gateway", "port": 8000}]
    off = {"httpRoute": {"enabled": False}}
    cluster.kube.patch("ServingPool", ns, "m-prefill", {"spec": {"gateway": off}})
    wait_for(lambda: cluster.kube.get("HTTPRoute", ns, "m-gateway") is None, what="route gone")


def test_services_whose_names_would_collide_both_get_their_own_children(
    cluster: Cluster,
) -> None:
    ns = "gateway-names"
    create(cluster, pool("a-gateway", "b", role="decode"), ns)
    create(cluster, pool("b-prefill", "b"), ns)
    create(cluster, pool("a-prefill", "a"), ns)
    expected = {"a-prefill", "b-prefill", "a-gateway-pool", "a-gateway", "b-gateway"}
    wait_for(lambda: cluster.names("Deployment", ns) == expected, what="both services' children")
    assert expected - {"a-prefill", "b-prefill", "a-gateway-pool"} <= cluster.names("Service", ns)
    time.sleep(3)  # several reconciles (1 s timers): nothing flips either over
    for kind in ("Deployment", "Service"):
        labels = cluster.get(kind, ns, "a-gateway")["metadata"]["labels"]
        assert (labels["flowprefill.io/service"], labels["flowprefill.io/role"]) == ("a", "gateway")
        labels = cluster.get(kind, ns, "a-gateway-pool")["metadata"]["labels"]
        assert (labels["flowprefill.io/service"], labels["flowprefill.io/role"]) == ("b", "decode")
    # Service b's gateway sends its decode requests to the pool's own Service.
    b_config = json.loads(cluster.get("ConfigMap", ns, "b-gateway")["data"]["gateway.json"])
    decode = b_config["decode"]
    assert [e["pool"] for e in decode] == ["a-gateway"]
    assert decode[0]["url"].startswith("http://a-gateway-pool.gateway-names.svc.")
    a_config = json.loads(cluster.get("ConfigMap", ns, "a-gateway")["data"]["gateway.json"])
    assert [e["pool"] for e in a_config["prefill"] + a_config["decode"]] == ["a-prefill"]
    # The pool's status reads its own Deployment, not the gateway's.
    wait_for(lambda: cluster.condition(ns, "a-gateway", "Degraded")[0] == "False", what="fine")
    status = cluster.get("ServingPool", ns, "a-gateway")["status"]
    assert status["selector"].endswith("flowprefill.io/pool=a-gateway")
