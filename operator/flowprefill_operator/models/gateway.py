"""``spec.gateway``: the service's gateway (replicas, autoscaling, a Gateway API route).

Like ``gatewayPod`` it is read from one pool of the service only: the one whose tokenizer
the gateway uses (the service's first prefill pool by name); the others' are ignored.
"""

from __future__ import annotations

import re

from pydantic import ConfigDict, Field, model_validator

from .common import DNS_LABEL, CRModel, cel

GATEWAY_SUFFIX = "-gateway"
"""The ending of the gateway's child names (``<service>-gateway``)."""

ESCAPE_SUFFIX = "-pool"
"""Appended to the child names of a pool whose own name could be a gateway's (below)."""

ESCAPED_POOL_NAME = re.compile(f"{GATEWAY_SUFFIX}({ESCAPE_SUFFIX})*$")
"""Pool names whose Deployment and Service take :data:`ESCAPE_SUFFIX`: ``…-gateway``,
``…-gateway-pool``, ``…-gateway-pool-pool`` …"""

MAX_ESCAPED_NAME = 63 - len(ESCAPE_SUFFIX)
"""The longest such pool name: its Service's name, a DNS-1035 label, must fit 63."""

MIN_ABOVE_MAX = "minReplicas must not exceed maxReplicas"


class GatewayAutoscaling(CRModel):
    """A HorizontalPodAutoscaler (autoscaling/v2) on the gateway's CPU utilisation; the HPA
    then owns the Deployment's replicas."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.minReplicas <= self.maxReplicas", MIN_ABOVE_MAX),
            ]
        }
    )

    min_replicas: int = Field(default=2, ge=1, le=1024, description="Fewest gateway pods.")
    max_replicas: int = Field(default=10, ge=1, le=1024, description="Most gateway pods.")
    target_cpu_utilization_percent: int = Field(
        default=70,
        ge=1,
        le=100,
        description="Average CPU utilisation (of the pods' CPU request) the HPA aims at.",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> GatewayAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(MIN_ABOVE_MAX)
        return self


class ParentRef(CRModel):
    """A Gateway API ``parentRef``: the Gateway (a listener of it) the route attaches to."""

    name: str = Field(max_length=253, description="Name of the Gateway.")
    namespace: str | None = Field(
        default=None,
        max_length=63,
        pattern=DNS_LABEL,
        description="Namespace of the Gateway; unset: the route's own namespace.",
    )
    section_name: str | None = Field(
        default=None, max_length=253, description="Listener of the Gateway (unset: all)."
    )
    port: int | None = Field(default=None, ge=1, le=65535, description="Listener port.")
    group: str | None = Field(
        default=None, max_length=253, description="API group (gateway.networking.k8s.io)."
    )
    kind: str | None = Field(default=None, max_length=63, description="Kind (Gateway).")


class GatewayRoute(CRModel):
    """A Gateway API ``HTTPRoute`` (gateway.networking.k8s.io/v1) sending every path of the
    listed hostnames to the gateway's Service: the gateway behind the Envoy/Istio/kgateway
    Gateway a cluster already runs."""

    enabled: bool = Field(
        default=True,
        description="false: no route for this service, whatever the operator's default.",
    )
    parent_refs: list[ParentRef] = Field(
        default_factory=list,
        max_length=16,
        description="Gateways to attach to; empty: the operator's default "
        "(the chart's children.gatewayRouteParentRefs). No route when both are empty.",
    )
    hostnames: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Host names the route answers (empty: every host of the listener).",
    )


class GatewaySpec(CRModel):
    """The service's gateway: how many pods, an HPA, a route."""

    replicas: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Gateway pods; unset: the operator's default (the chart's "
        "children.gatewayReplicas). With more than one the operator adds a PodDisruptionBudget.",
    )
    autoscaling: GatewayAutoscaling | None = Field(
        default=None,
        description="An HPA on the gateway's CPU (replaces replicas: the HPA owns them).",
    )
    http_route: GatewayRoute | None = Field(
        default=None,
        description="A Gateway API HTTPRoute to the gateway's Service (docs/pods.md).",
    )


def pool_workload_name(pool: str) -> str:
    """The name of a pool's Deployment and Service: the pool's own name, except for a name
    that :data:`ESCAPED_POOL_NAME` matches, which gets :data:`ESCAPE_SUFFIX`.

    Contract: no two pools, and no pool and a gateway, of any services in a namespace get
    the same name. Unescaped results never match the pattern, escaped ones always do and
    end in ``-pool`` (so they are no gateway's ``<service>-gateway``), and stripping one
    suffix gives the pool back. So pool ``a-gateway`` of service ``b`` runs as
    ``a-gateway-pool`` beside service ``a``'s gateway, and pool ``a-gateway-pool`` as
    ``a-gateway-pool-pool``. Every other name (all of them in practice) is unchanged.
    """
    return f"{pool}{ESCAPE_SUFFIX}" if ESCAPED_POOL_NAME.search(pool) else pool


ESCAPED_NAME_TOO_LONG = (
    f"a pool whose name ends in {GATEWAY_SUFFIX} (or {GATEWAY_SUFFIX}{ESCAPE_SUFFIX}...) names its "
    f"Deployment and Service <name>{ESCAPE_SUFFIX}, so that no service's gateway "
    f"(<service>{GATEWAY_SUFFIX}) shares them; such a name may have at most "
    f"{MAX_ESCAPED_NAME} characters"
)


def pool_name_problem(name: str) -> str | None:
    """Why a pool may not have ``name`` (the CRD's rule, in Python, for pools admitted
    without it: an older CRD, the emulator); None when it may."""
    too_long = ESCAPED_POOL_NAME.search(name) and len(name) > MAX_ESCAPED_NAME
    return ESCAPED_NAME_TOO_LONG if too_long else None
