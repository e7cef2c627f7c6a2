"""kopf handlers: thin. Parse, call the reconciler, post events, map errors to retries.

Run: ``kopf run -m flowprefill_operator.handlers --all-namespaces`` (or ``-n NS`` ...),
with ``--liveness=http://0.0.0.0:8080/healthz`` for the probe.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import kopf

from . import GROUP, VERSION
from .kube import ApiError, Kube, load_client
from .reconcile import Event, Reconciler, now_rfc3339
from .settings import OperatorSettings

SETTINGS = OperatorSettings.from_env()
POOLS = (GROUP, VERSION, "servingpools")
CLASSES = (GROUP, VERSION, "sloclasses")
T = TypeVar("T")

_state: dict[str, Any] = {}
# Per-namespace fingerprints of the SLOClasses last synced: (uid, generation, labels).
_synced: dict[str, set[tuple[str, Any, str]]] = {}


def reconciler() -> Reconciler:
    rec = _state.get("reconciler")
    if rec is None:
        rec = Reconciler(Kube(load_client(), SETTINGS.api_timeout_s), SETTINGS)
        _state["reconciler"] = rec
    assert isinstance(rec, Reconciler)
    return rec


def peering_priority(pod_name: str) -> int:
    """Distinct per replica: kopf freezes peers of equal priority, the highest one runs."""
    return int(hashlib.sha256(pod_name.encode()).hexdigest()[:7], 16)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # our own events only, not every handler run
    settings.networking.request_timeout = SETTINGS.api_timeout_s * 3
    settings.watching.server_timeout = 300
    settings.peering.priority = peering_priority(os.environ.get("POD_NAME", "") or "standalone")
    reconciler()
    _state["started"] = now_rfc3339()


@kopf.on.probe(id="reconciler")
def probe(**_: Any) -> str:
    return str(_state.get("last_reconcile", _state.get("started", "")))


def _post(body: Any, events: list[Event]) -> None:
    for e in events:
        kopf.event(body, type=e.type, reason=e.reason, message=e.message[:1024])


def _retrying(retry: int, fn: Callable[[], T]) -> T:
    """Run one API-bound step; API errors become kopf retries with growing delays."""
    try:
        return fn()
    except ApiError as e:
        delay = min(2 ** min(retry, 6), 60) if e.transient else 60
        raise kopf.TemporaryError(f"Kubernetes API: {e}", delay=delay) from e


# ---- ServingPool ---------------------------------------------------------------------------


@kopf.on.resume(*POOLS)
@kopf.on.create(*POOLS)
@kopf.on.update(*POOLS)
def reconcile_pool(body: kopf.Body, retry: int, **_: Any) -> None:
    result = _retrying(retry, lambda: reconciler().reconcile_pool(dict(body)))
    _post(body, result.events)
    _state["last_reconcile"] = now_rfc3339()
    if result.invalid:
        raise kopf.PermanentError(f"invalid spec: {result.invalid}")


@kopf.timer(*POOLS, interval=SETTINGS.reconcile_interval_s, initial_delay=1.0)
def refresh_pool(
    body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any
) -> None:
    # Re-apply children (repairs drift) and fold their state into status.
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    namespace = body["metadata"]["namespace"]
    if namespace not in _synced:  # a failed or missed SLOClass sync: repeat it
        _sync_classes(namespace)
    try:
        result = reconciler().reconcile_pool(dict(body))
        # Gateways only exist where pools do, so pools' timers also carry the attainment
        # job (rate-limited per namespace); SLOClasses then need no timer, no finalizer.
        reconciler().write_attainment(namespace)
    except ApiError as e:
        logger.warning("periodic reconcile failed (next run retries): %s", e)
        return
    _post(body, result.events)
    _state["last_reconcile"] = now_rfc3339()


@kopf.on.delete(*POOLS)
def delete_pool(body: kopf.Body, retry: int, **_: Any) -> None:
    _retrying(retry, lambda: reconciler().delete_pool(dict(body)))


# ---- SLOClass ------------------------------------------------------------------------------


def _fingerprint(body: Mapping[str, Any]) -> tuple[str, Any, str]:
    meta = body.get("metadata", {})
    labels = ",".join(f"{k}={v}" for k, v in sorted((meta.get("labels") or {}).items()))
    return (str(meta.get("uid")), meta.get("generation"), labels)


def _sync_classes(namespace: str) -> None:
    rec = reconciler()
    try:
        events = rec.sync_classes(namespace)
        listed = rec.kube.list("SLOClass", namespace)
    except ApiError as e:
        # on.event handlers are not retried: the attainment timer repeats the sync.
        logging.getLogger(__name__).warning("SLO class sync in %s failed: %s", namespace, e)
        _synced.pop(namespace, None)
        return
    _synced[namespace] = {_fingerprint(o) for o in listed}
    for obj, ev in events:
        _post(obj, [ev])


@kopf.on.event(*CLASSES)
def sloclass_changed(type: str, body: kopf.Body, namespace: str | None, **_: Any) -> None:
    """Any change of spec or labels (or a deletion) re-judges the namespace's classes and
    rewrites the SLO tables of its services; status-only writes are skipped."""
    if namespace is None:
        return
    if type != "DELETED" and _fingerprint(body) in _synced.get(namespace, set()):
        return
    _sync_classes(namespace)
