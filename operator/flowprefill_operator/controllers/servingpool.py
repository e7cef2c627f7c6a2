"""ServingPool controller: a pool's own children (Deployment, Service, engine ConfigMap)
and its status; then its service's gateway through the gateway controller.

Level-based: the create/update/resume handlers and a timer run the same
:func:`reconcile_pool` (parse, check references, build with the pure builders, apply,
fold the children's state into status), so running it twice, or after a restart,
changes nothing that is already right. The service's other pools and the namespace's
classes come from the indexes; Events are returned as data and posted by the handlers.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from .. import MANAGED_BY
from .. import finalizer as finalizer_
from ..builders import (
    PoolRef,
    build_pool_children,
    gateway_url,
    pool_selector,
    selector_string,
)
from ..builders.common import gateway_selector
from ..builders.gateway import tokenizer_pool
from ..builders.model import FETCH_TOKENIZER_CONTAINER
from ..builders.overlay import OverlayConflict
from ..builders.pool import engine_configmap_name
from ..kube import ApiError
from ..models import ServingPoolSpec, ServingPoolStatus
from ..models.gateway import pool_name_problem, pool_workload_name
from ..status import Observed, Problem, fold_status, pod_problems
from .common import (
    POOLS,
    SETTINGS,
    Body,
    Context,
    Event,
    apply_children,
    context,
    health,
    now_rfc3339,
    parse_status,
    post,
    retrying,
    validation_message,
)
from .gateway import sync_gateway
from .indexes import ClassEntry, class_index, classes_of, pool_index, pools_of
from .kvcheck import kv_mismatch, nixl_problems
from .modelcheck import model_problems
from .sloclass import judge
from .upgrades import gate_deployment


@dataclass
class PoolResult:
    """What one reconcile did: the status, whether it was written, the Events to post,
    and the validation message when the spec is invalid (no children were applied)."""

    status: ServingPoolStatus
    changed: bool
    invalid: str | None = None
    events: list[Event] = field(default_factory=list)


def status_events(before: ServingPoolStatus, after: ServingPoolStatus) -> list[Event]:
    """A Warning when Degraded turns True (or changes reason), Normal when Ready turns True."""

    def cond(s: ServingPoolStatus, t: str) -> tuple[str, str]:
        c = next((c for c in s.conditions if c.type == t), None)
        return (c.status, c.reason) if c else ("Unknown", "")

    events = []
    degraded = next(c for c in after.conditions if c.type == "Degraded")
    if degraded.status == "True" and cond(before, "Degraded") != ("True", degraded.reason):
        events.append(Event("Warning", degraded.reason, degraded.message))
    ready = next(c for c in after.conditions if c.type == "Ready")
    if ready.status == "True" and cond(before, "Ready")[0] != "True":
        events.append(Event("Normal", "Ready", ready.message))
    return events


def preflight(ctx: Context, pool: PoolRef, peers: list[PoolRef]) -> list[Problem]:
    """References that must exist for the pods to start (checked, not waited for), and
    the model source's own check (:mod:`.modelcheck`)."""
    kube, spec, ns = ctx.kube, pool.spec, pool.namespace
    problems = model_problems(kube, ns, spec.model, ctx.settings, ctx.model_checks)
    kv = spec.kv_handoff
    if kv and kv.claim_name and not kube.get("PersistentVolumeClaim", ns, kv.claim_name):
        problems.append(Problem("KVVolumeNotFound", f"PVC {kv.claim_name!r} not found"))
    problems += kv_mismatch(pool, peers)
    problems += nixl_problems(pool, peers)
    profile = spec.engine.ttft_profile if spec.engine else None
    if profile:
        cm = kube.get("ConfigMap", ns, profile.name)
        if cm is None:
            problems.append(Problem("ProfileNotFound", f"ConfigMap {profile.name!r} not found"))
        elif profile.key not in (cm.get("data") or {}):
            problems.append(
                Problem("ProfileNotFound", f"ConfigMap {profile.name!r} has no {profile.key!r}")
            )
    return problems


def reconcile_pool(
    ctx: Context,
    body: Body,
    peers: list[PoolRef],
    classes: list[ClassEntry],
    served: Collection[str] = (),
) -> PoolResult:
    """Converge one pool's children, its service's gateway and its status.

    ``peers``: the pools of its service as indexed (this one included once its spec is
    valid); ``classes``: the namespace's SLOClasses; ``served``: the namespaces of every
    pool this operator serves (where operator-caused rollouts are counted, see
    :mod:`.upgrades`; the pool's own is always one).
    """
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    with ctx.locks("pool", namespace, name):
        generation = meta.get("generation")
        previous: ServingPoolStatus = parse_status(ServingPoolStatus, body.get("status"))
        raw_spec = body.get("spec") or {}
        selector = selector_string(pool_selector(name))
        try:
            spec = ServingPoolSpec.model_validate(raw_spec)
            if problem := pool_name_problem(name):  # the CRD's rule on the name
                raise ValueError(problem)
        except ValueError as e:  # pydantic's ValidationError is one
            message = validation_message(e) if isinstance(e, ValidationError) else str(e)
            replicas = raw_spec.get("replicas")
            observed = Observed(
                generation=generation,
                desired_replicas=replicas if isinstance(replicas, int) else 0,
                deployment=ctx.kube.get("Deployment", namespace, pool_workload_name(name)),
                problems=[Problem("InvalidSpec", message, invalid_spec=True)],
            )
            status = fold_status(observed, previous, now_rfc3339(), selector=selector, gateway="")
            return write_status(ctx, namespace, name, previous, status, invalid=message)

        pool = PoolRef(name=name, namespace=namespace, uid=meta["uid"], spec=spec)
        # The index may not hold this very version yet (a timer's body can be newer).
        peers = sorted([p for p in peers if p.name != name] + [pool], key=lambda p: p.name)
        problems = preflight(ctx, pool, peers)
        try:
            children = build_pool_children(pool, ctx.settings)
        except OverlayConflict as e:
            problems.append(Problem("PodOverlayConflict", f"pod: {e}", invalid_spec=True))
            children = build_pool_children(pool, ctx.settings, overlay=False)
        blocked = any(p.blocks_pods or p.invalid_spec for p in problems)
        # Pods that cannot start: keep what runs (if anything) as it is. A refused child
        # goes first in the list: it is the Degraded reason, and Ready is False.
        applied = apply_children(ctx.kube, (m for m in children if m["kind"] != "Deployment"))
        pending = None
        if not blocked:
            deployment = next(m for m in children if m["kind"] == "Deployment")
            # One decision at a time: two pools must not take the wave's last slot together.
            with ctx.locks("upgrade-gate"):
                gate = gate_deployment(
                    ctx.kube,
                    deployment,
                    raw_spec,
                    {namespace, *served},
                    ctx.settings.max_pools_updating,
                )
                applied = apply_children(ctx.kube, [gate.deployment]) + applied
            pending = gate.pending
        problems = applied + problems
        gateway_problems = sync_gateway(
            ctx, namespace, spec.service, peers, judge(ctx, namespace, classes)
        )
        if tokenizer_pool(peers).name == name:
            # Reported by the pool whose model (tokenizer) and gatewayPod the gateway uses:
            # its overlay's conflicts, and its pods' failed tokenizer downloads.
            problems += gateway_problems
            gateway_pods = ctx.kube.list("Pod", namespace, gateway_selector(spec.service))
            problems += [
                p
                for p in pod_problems(gateway_pods)
                if p.reason.startswith("Model") and FETCH_TOKENIZER_CONTAINER in p.message
            ]
        observed = Observed(
            generation=generation,
            desired_replicas=spec.replicas,
            deployment=ctx.kube.get("Deployment", namespace, pool_workload_name(name)),
            pods=ctx.kube.list("Pod", namespace, pool_selector(name)),
            problems=problems,
            update_pending=pending,
        )
        status = fold_status(
            observed,
            previous,
            now_rfc3339(),
            selector=selector,
            gateway=gateway_url(spec.service, namespace, ctx.settings),
        )
        return write_status(ctx, namespace, name, previous, status)


def write_status(
    ctx: Context,
    namespace: str,
    name: str,
    previous: ServingPoolStatus,
    status: ServingPoolStatus,
    invalid: str | None = None,
) -> PoolResult:
    """Patch the status only when it changed (transition times are kept by fold_status).
    ``autoscaler`` belongs to the autoscale controller: kept as it was, never written here
    (a stale copy from this reconcile's body would undo a newer decision)."""
    status = status.model_copy(update={"autoscaler": previous.autoscaler})
    ours = {k: v for k, v in status.wire().items() if k != "autoscaler"}
    changed = ours != {k: v for k, v in previous.wire().items() if k != "autoscaler"}
    if changed:
        ctx.kube.patch("ServingPool", namespace, name, {"status": ours}, sub="status")
    return PoolResult(status, changed, invalid, status_events(previous, status))


def delete_pool(ctx: Context, body: Body, peers: list[PoolRef], classes: list[ClassEntry]) -> None:
    """Remove the pool's children now (the GC would too, via owner references) and drop
    it from its service's gateway (``peers``: the service's remaining pools)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    with ctx.locks("pool", namespace, name):
        for kind, child in (
            ("Deployment", pool_workload_name(name)),
            ("Service", pool_workload_name(name)),
            ("ConfigMap", engine_configmap_name(name)),
        ):
            ctx.kube.delete_managed(kind, namespace, child, MANAGED_BY)
    service = (body.get("spec") or {}).get("service")
    if isinstance(service, str):
        remaining = [p for p in peers if p.name != name]
        sync_gateway(ctx, namespace, service, remaining, judge(ctx, namespace, classes))


# ---- kopf handlers ---------------------------------------------------------------------
# Handler ids are explicit: kopf keeps them in the objects' progress annotations, so they
# must not change when a function is renamed.


def _inputs(
    body: kopf.Body, kwargs: dict[str, Any]
) -> tuple[Body, list[PoolRef], list[ClassEntry], set[str]]:
    """The body as a plain dict, the pools of its service, its namespace's classes and
    the namespaces of every pool served."""
    raw = dict(body)
    namespace = raw["metadata"]["namespace"]
    service = (raw.get("spec") or {}).get("service")
    pools = pool_index(kwargs)
    peers = pools_of(pools, namespace, service) if isinstance(service, str) else []
    served: ServedIndex = kwargs["served_pools"]
    namespaces = {ns for ns, _ in served.get(None, [])}
    return raw, peers, classes_of(class_index(kwargs), namespace), namespaces


@kopf.on.resume(*POOLS, id="reconcile_pool")
@kopf.on.create(*POOLS, id="reconcile_pool")
@kopf.on.update(*POOLS, id="reconcile_pool")
def pool_changed(body: kopf.Body, retry: int, memo: kopf.Memo, **kwargs: Any) -> None:
    """Created, changed, or found on startup: reconcile now; API errors retry with backoff,
    an invalid spec stops retrying this generation (its status says why)."""
    health(memo).handled = True
    inputs = _inputs(body, kwargs)
    result = retrying(retry, lambda: reconcile_pool(context(memo), *inputs))
    post(body, result.events)
    health(memo).reconciled()
    if result.invalid:
        raise kopf.PermanentError(f"invalid spec: {result.invalid}")


@kopf.timer(*POOLS, id="refresh_pool", interval=SETTINGS.reconcile_interval_s, initial_delay=1.0)
def refresh_pool(
    body: kopf.Body,
    memo: kopf.Memo,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **kwargs: Any,
) -> None:
    """Re-apply the children (repairs drift) and fold their state into status."""
    health(memo).handled = True
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    inputs = _inputs(body, kwargs)
    try:
        result = reconcile_pool(context(memo), *inputs)
    except ApiError as e:
        logger.warning("periodic reconcile failed (next run retries): %s", e)
        return
    post(body, result.events)
    health(memo).reconciled()


@kopf.on.delete(*POOLS, id="delete_pool", optional=True)
def pool_deleted(body: kopf.Body, retry: int, memo: kopf.Memo, **kwargs: Any) -> None:
    """Deleting while the operator runs: drop the pool from its gateway now (best effort:
    ``optional``, so this handler needs no finalizer; owner references garbage-collect the
    children anyway, and the service's other pools' timers rewrite the gateway)."""
    raw, peers, classes, _ = _inputs(body, kwargs)
    retrying(retry, lambda: delete_pool(context(memo), raw, peers, classes))


# ---- the finalizer kopf's timers need --------------------------------------------------
# kopf puts its finalizer (settings.persistence.finalizer) on every object that has timers
# (refresh, SLO class resync, attainment, autoscale) so that it can stop them before the
# object disappears; kopf offers no timer without one. It guards only this process's
# timers: once the process stops there is nothing left to clean up, and a pool deleted
# after the operator was uninstalled would otherwise hang in Terminating (and its
# namespace with it). So the operator releases it from every pool on a graceful exit; a
# new process puts it back on the pools it resumes.

ServedIndex = kopf.Index[None, tuple[str, str]]


@kopf.index(*POOLS)
def served_pools(namespace: str | None, name: str, **_: Any) -> dict[None, tuple[str, str]]:
    """Every pool this process watches, valid or not (kopf's timers run on each)."""
    return {None: (namespace, name)} if namespace else {}


def release_finalizer(ctx: Context, namespace: str, name: str, finalizer: str) -> bool:
    """Remove ``finalizer`` from one pool, others' stay (the one implementation, shared
    with the chart's pre-delete hook: :func:`..finalizer.release_finalizer`)."""
    return finalizer_.release_finalizer(ctx.kube, namespace, name, finalizer)


@kopf.on.cleanup()
def release_finalizers(
    memo: kopf.Memo,
    settings: kopf.OperatorSettings,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **kwargs: Any,
) -> None:
    """On a graceful exit (kopf runs cleanup after its watches and timers stopped, so
    nothing puts it back): release kopf's finalizer from every pool served, unless this
    process never handled one (a peering standby: the active peer still needs it). A
    restart so writes each pool twice (released, then put back on resume)."""
    if not health(memo).handled:
        # A standby that never took over: the finalizers are the active peer's to keep.
        logger.info("no pool was handled by this process: no finalizer to release")
        return
    index: ServedIndex = kwargs["served_pools"]
    ctx, finalizer = context(memo), settings.persistence.finalizer
    released = 0
    for namespace, name in sorted(set(index.get(None, []))):
        try:
            released += release_finalizer(ctx, namespace, name, finalizer)
        except ApiError as e:
            logger.warning("finalizer of %s/%s not released: %s", namespace, name, e)
    logger.info("released the finalizer of %d pools on exit", released)
