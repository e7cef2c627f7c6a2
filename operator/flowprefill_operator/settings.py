"""Operator settings: read once from ``FLOWPREFILL_OPERATOR_*`` environment variables.

The Helm chart sets them from values.yaml; every field has a safe default for tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flowprefill.contracts.deployment import OPERATOR_ENV_PREFIX

from .models.gateway import ParentRef

ENV_PREFIX = OPERATOR_ENV_PREFIX


class OperatorSettings(BaseModel):
    """Knobs of the operator process (not of any one custom resource)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill_image: str = Field(
        default="ghcr.io/flowprefill/prefill:0.1.0", description="Default prefill engine image."
    )
    decode_image: str = Field(
        default="ghcr.io/flowprefill/decode:0.1.0", description="Default vLLM decode image."
    )
    gateway_image: str = Field(
        default="ghcr.io/flowprefill/gateway:0.1.0", description="Gateway image."
    )
    image_pull_policy: str = Field(default="IfNotPresent", description="Pull policy of children.")
    gateway_replicas: int = Field(
        default=1,
        ge=1,
        description="Gateway pods per service unless its pool sets gateway.replicas (the "
        "chart's children.gatewayReplicas); above 1 with a PodDisruptionBudget.",
    )
    gateway_route_parent_refs: tuple[ParentRef, ...] = Field(
        default=(),
        description="parentRefs of the HTTPRoute the operator adds for every service (the "
        "chart's children.gatewayRouteParentRefs; JSON in the environment); empty: a route "
        "only for services whose pool sets gateway.httpRoute.parentRefs.",
    )
    max_pools_updating: int = Field(
        default=1,
        ge=0,
        description="Pools that may roll a pod-template change of the operator's own (an "
        "upgrade, new default images) at once, across every namespace it serves; the rest "
        "wait with condition UpdatePending (the chart's operator.maxPoolsUpdating; 0 = no "
        "limit). A change of a pool's spec is applied at once.",
    )
    cluster_domain: str = Field(default="cluster.local", description="Cluster DNS domain.")
    reconcile_interval_s: float = Field(
        default=30.0, gt=0, description="Timer: re-apply children and fold their state into status."
    )
    attainment_interval_s: float = Field(
        default=30.0, gt=0, description="Timer: scrape gateway metrics into SLOClass status."
    )
    attainment_window_s: float = Field(
        default=300.0, gt=0, description="Window the SLOClass attainment covers."
    )
    autoscale_interval_s: float = Field(
        default=30.0,
        gt=0,
        description="Timer: the autoscaler's decisions for pools with replicasOwner operator.",
    )
    metrics_port: int = Field(
        default=8081, ge=0, le=65535, description="Port of the operator's /metrics (0 = off)."
    )
    scrape_timeout_s: float = Field(default=3.0, gt=0, description="Timeout of one metrics scrape.")
    api_timeout_s: float = Field(default=10.0, gt=0, description="Timeout of one API request.")
    watch_scope: Literal["cluster", "namespaced"] = Field(
        default="cluster",
        description="The chart's watch.scope; namespaced: kopf does not scan namespaces or "
        "watch CRDs (a Role cannot grant either).",
    )
    child_image_pull_secrets: tuple[str, ...] = Field(
        default=(),
        description="imagePullSecrets of every child pod (the chart's "
        "children.imagePullSecrets; comma-separated in the environment), before a pool's own.",
    )
    hf_endpoint: str | None = Field(
        default=None,
        description="The Hub's base URL (a mirror) for the operator's model check and the "
        "pods' download steps; unset = huggingface_hub's default.",
    )
    model_check: bool = Field(
        default=True,
        description="Check an hf:// source (repository, revision, token) from the operator "
        "before creating pods: a wrong token or a missing repository becomes a condition "
        "and an Event instead of pods whose download step fails. Off where the operator "
        "cannot reach the Hub (the pods' download step still reports).",
    )

    @field_validator("child_image_pull_secrets", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("gateway_route_parent_refs", mode="before")
    @classmethod
    def _json(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(json.loads(value) or ()) if value.strip() else ()
        return value

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            key = ENV_PREFIX + name.upper()
            if key in env:
                values[name] = env[key]
        return cls.model_validate(values)
