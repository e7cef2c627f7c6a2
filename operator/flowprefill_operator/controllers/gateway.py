"""Gateway controller: one gateway per service (Deployment, Service, gateway.json ConfigMap
and the SLO table ConfigMap), owned jointly by the service's pools.

It has no custom resource of its own and no kopf handlers: the pool and SLOClass
controllers call :func:`sync_gateway` with what their indexes hold whenever one of its
inputs (the service's pools, the namespace's classes) may have changed. Level-based: it
converges the children to those inputs, and removes them when the service has no pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .. import MANAGED_BY
from ..builders import (
    PoolRef,
    SLOClassView,
    Verdict,
    build_gateway_children,
    build_slo_table,
    gateway_name,
    slo_table_name,
)
from ..builders.common import Manifest
from ..builders.overlay import OverlayConflict
from ..kube import ApiError
from ..status import Problem
from .common import Context, apply_children

log = logging.getLogger(__name__)

OPTIONAL_KINDS = ("PodDisruptionBudget", "HorizontalPodAutoscaler", "HTTPRoute")
"""Gateway children that exist only as the tokenizer pool's ``gateway`` asks
(:mod:`..builders.gateway_ha`); all named :func:`gateway_name`."""


@dataclass(frozen=True)
class JudgedClasses:
    """A namespace's SLOClasses with their verdicts and the API-key hashes of the Secrets
    they reference (None: the Secret does not exist)."""

    views: list[SLOClassView]
    secrets: dict[str, list[str] | None]
    verdicts: dict[str, Verdict]


def sync_gateway(
    ctx: Context, namespace: str, service: str, pools: list[PoolRef], classes: JudgedClasses
) -> list[Problem]:
    """Apply the service's gateway children for ``pools`` (all of one service), or delete
    them when ``pools`` is empty. Returns what keeps the gateway from being applied as
    specified: a ``gatewayPod`` overlay in conflict with the pod (its Deployment is then
    left as it is), and children the API server refused or that are not ours
    (:func:`.common.apply_children`)."""
    with ctx.locks("gateway", namespace, service):
        if not pools:
            for kind, child in (
                ("Deployment", gateway_name(service)),
                ("Service", gateway_name(service)),
                ("ConfigMap", gateway_name(service)),
                ("ConfigMap", slo_table_name(service)),
            ):
                ctx.kube.delete_managed(kind, namespace, child, MANAGED_BY)
            remove_optional(ctx, namespace, service, keep=set())
            return []
        selectors = [p.spec.slo_class_selector for p in pools]
        table = build_slo_table(classes.views, selectors, classes.verdicts, classes.secrets)
        problems: list[Problem] = []
        try:
            children = build_gateway_children(pools, table, ctx.settings)
        except OverlayConflict as e:
            problems.append(Problem("PodOverlayConflict", f"gatewayPod: {e}", invalid_spec=True))
            children = [
                m
                for m in build_gateway_children(pools, table, ctx.settings, overlay=False)
                if m["kind"] != "Deployment"
            ]
        children = with_hpa_replicas(ctx, children)
        problems = apply_children(ctx.kube, children) + problems
        remove_optional(ctx, namespace, service, keep={m["kind"] for m in children})
        return problems


def with_hpa_replicas(ctx: Context, children: list[Manifest]) -> list[Manifest]:
    """With an HPA the gateway Deployment is rendered without ``replicas``; it gets the
    live count here (the HPA's minimum before it exists), so the apply writes no change.
    Leaving the field out would make the apply remove the count it wrote before (a
    three-way merge) and the API server reset it to 1: the gateway would drop to one pod
    when its HPA is turned on, until the HPA scaled it back."""
    hpa = next((m for m in children if m["kind"] == "HorizontalPodAutoscaler"), None)
    out = []
    for manifest in children:
        if hpa is not None and manifest["kind"] == "Deployment":
            meta = manifest["metadata"]
            live = ctx.kube.get("Deployment", meta["namespace"], meta["name"])
            replicas = (live or {}).get("spec", {}).get("replicas")
            if not isinstance(replicas, int):
                replicas = hpa["spec"]["minReplicas"]
            manifest = {**manifest, "spec": {"replicas": replicas, **manifest["spec"]}}
        out.append(manifest)
    return out


def remove_optional(ctx: Context, namespace: str, service: str, keep: set[str]) -> None:
    """Delete the gateway's optional children (:data:`OPTIONAL_KINDS`) not in ``keep``: a
    PDB once one pod is asked for, an HPA once autoscaling is off, a route once unset.
    Only ours (the managed-by label). A refusal other than a transient one (a cluster
    without the Gateway API answers 404, an operator not granted the kind 403) is logged:
    what was never created cannot be left behind."""
    for kind in OPTIONAL_KINDS:
        if kind in keep:
            continue
        try:
            ctx.kube.delete_managed(kind, namespace, gateway_name(service), MANAGED_BY)
        except ApiError as e:
            if e.transient:
                raise
            log.debug("not removing %s %s/%s: %s", kind, namespace, gateway_name(service), e)
