"""Pure: what keeps a service's gateway up — its replicas, spread, disruption budget, HPA —
and the Gateway API route that puts it behind a cluster's own Gateway.

The settings come from ``spec.gateway`` of the pool the gateway reads its tokenizer from
(as ``gatewayPod`` does), else the operator's defaults (:class:`OperatorSettings`).
"""

from __future__ import annotations

from typing import Any

from flowprefill.contracts.deployment import GATEWAY_PORT

from ..models.gateway import GatewaySpec
from ..settings import OperatorSettings
from .common import Manifest

HTTPROUTE_API = "gateway.networking.k8s.io/v1"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
ANTI_AFFINITY_WEIGHT = 100


def gateway_replicas(spec: GatewaySpec | None, settings: OperatorSettings) -> int:
    """Pods the gateway runs (without an HPA): the pool's ``gateway.replicas``, else the
    operator's ``gateway_replicas``."""
    if spec is not None and spec.replicas is not None:
        return spec.replicas
    return settings.gateway_replicas


def min_replicas(spec: GatewaySpec | None, settings: OperatorSettings) -> int:
    """The fewest pods the gateway runs: the HPA's minReplicas, else its fixed replicas."""
    if spec is not None and spec.autoscaling is not None:
        return spec.autoscaling.min_replicas
    return gateway_replicas(spec, settings)


def anti_affinity(selector: dict[str, str]) -> dict[str, Any]:
    """Preferred (not required) spread of the gateway's pods over nodes: one node going
    away takes one of them, and a one-node cluster still schedules them all."""
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": ANTI_AFFINITY_WEIGHT,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": dict(selector)},
                        "topologyKey": HOSTNAME_TOPOLOGY,
                    },
                }
            ]
        }
    }


def gateway_strategy() -> dict[str, Any]:
    """Surge one pod, never fewer ready than asked: the gateway needs no GPU to surge."""
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def build_pdb(
    meta: dict[str, Any], selector: dict[str, str], spec: GatewaySpec | None,
    settings: OperatorSettings,
) -> Manifest | None:  # fmt: skip
    """A PodDisruptionBudget (policy/v1) letting a drain evict one gateway pod at a time;
    None when the gateway may run one pod (a budget would then block every node drain)."""
    if min_replicas(spec, settings) < 2:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta,
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(selector)}},
    }


def build_hpa(meta: dict[str, Any], deployment: str, spec: GatewaySpec | None) -> Manifest | None:
    """A HorizontalPodAutoscaler (autoscaling/v2) on the gateway Deployment's average CPU
    utilisation; None without ``gateway.autoscaling``."""
    if spec is None or spec.autoscaling is None:
        return None
    auto = spec.autoscaling
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {
                        "name": "cpu",
                        "target": {
                            "type": "Utilization",
                            "averageUtilization": auto.target_cpu_utilization_percent,
                        },
                    },
                }
            ],
        },
    }


def build_http_route(
    meta: dict[str, Any], service_name: str, spec: GatewaySpec | None,
    settings: OperatorSettings,
) -> Manifest | None:  # fmt: skip
    """An HTTPRoute (gateway.networking.k8s.io/v1) sending every path to the gateway's
    Service; parentRefs from ``gateway.httpRoute`` or the operator's default. None when
    the pool turns it off or neither names a parent."""
    route = spec.http_route if spec is not None else None
    if route is not None and not route.enabled:
        return None
    parents = list(route.parent_refs) if route and route.parent_refs else []
    parents = parents or list(settings.gateway_route_parent_refs)
    if not parents:
        return None
    route_spec: dict[str, Any] = {
        "parentRefs": [p.wire() for p in parents],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"name": service_name, "port": GATEWAY_PORT}],
            }
        ],
    }
    if route is not None and route.hostnames:
        route_spec["hostnames"] = list(route.hostnames)
    return {"apiVersion": HTTPROUTE_API, "kind": "HTTPRoute", "metadata": meta, "spec": route_spec}
