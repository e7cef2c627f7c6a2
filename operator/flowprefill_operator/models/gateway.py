"""``spec.gateway``: the service's gateway (replicas, autoscaling, a Gateway API route).

Like ``gatewayPod`` it is read from one pool of the service only: the one whose tokenizer
the gateway uses (the service's first prefill pool by name); the others' are ignored.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from .common import DNS_LABEL, CRModel, cel

GATEWAY_SUFFIX = "-gateway"
"""The ending of the gateway's child names (``<service>-gateway``). No pool may end its
name with it (the CRD refuses it): a pool's Deployment and Service take the pool's name,
so a pool ``a-gateway`` of service ``b`` would take service ``a``'s gateway objects."""

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


RESERVED_POOL_NAME = (
    f"a name ending in {GATEWAY_SUFFIX} is reserved for the services' gateways "
    f"(<service>{GATEWAY_SUFFIX}, whatever the pool's service)"
)


def reserved_pool_name(name: str) -> str | None:
    """Why a pool may not have ``name`` (the CRD's rule, in Python, for pools admitted
    without it: an older CRD, the emulator); None when it may."""
    return RESERVED_POOL_NAME if name.endswith(GATEWAY_SUFFIX) else None
