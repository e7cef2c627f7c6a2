"""SLOClass controller: acceptance of every class of a namespace (status ``accepted``,
``reason``, ``message`` and the ``Ready`` condition; ``Degraded`` and the attainment
fields are the attainment job's, see :mod:`..classstatus`) and, through the gateway
controller, the SLO table of every service there.

Any change of a class's spec or labels, or a deletion, re-judges the whole namespace (a
second default or a missing Secret is a property of the set, not of one class). The
classes are read from the ``classes_by_namespace`` index; :class:`ClassSync` (in kopf's
memo) remembers the inputs of the last complete sync per namespace, so the events of the
operator's own status writes change nothing, and a failed sync is repeated by a timer on
the pools (``on.event`` handlers are not retried; SLOClasses carry no finalizer and so
no timer of their own).
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
from collections.abc import Mapping
from typing import Any

import kopf

from ..builders import PoolRef, Verdict, judge_classes, sha256_hex
from ..classstatus import ready_condition, set_condition
from ..kube import ApiError
from ..models import SLOClassStatus
from ..statuspatch import patch_status
from .common import (
    CLASSES,
    POOLS,
    SETTINGS,
    Context,
    Event,
    context,
    from_memo,
    now_rfc3339,
    parse_status,
    post,
)
from .gateway import JudgedClasses, sync_gateway
from .indexes import (
    ClassEntry,
    ClassIndex,
    PoolIndex,
    class_index,
    classes_of,
    pool_index,
    pools_of,
    services_of,
)

log = logging.getLogger(__name__)

# What a sync depends on, per class: identity and the parsed view (not the status).
Inputs = tuple[tuple[str, Any], ...]


class ClassSync:
    """Per namespace, the SLOClass inputs of the last sync that completed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._synced: dict[str, Inputs] = {}

    @staticmethod
    def inputs(entries: list[ClassEntry]) -> Inputs:
        return tuple((str(e.ref["metadata"]["uid"]), e.view) for e in entries)

    def is_current(self, namespace: str, entries: list[ClassEntry]) -> bool:
        with self._lock:
            return self._synced.get(namespace) == self.inputs(entries)

    def record(self, namespace: str, entries: list[ClassEntry]) -> None:
        with self._lock:
            self._synced[namespace] = self.inputs(entries)


def secret_hashes(ctx: Context, namespace: str, name: str) -> list[str] | None:
    """sha256 of every API key in a Secret's values; None when the Secret does not exist."""
    secret = ctx.kube.get("Secret", namespace, name)
    if secret is None:
        return None
    hashes = []
    for value in (secret.get("data") or {}).values():
        try:
            key = base64.b64decode(value).decode().strip()
        except (binascii.Error, UnicodeDecodeError):
            continue
        if key:
            hashes.append(sha256_hex(key))
    return hashes


def judge(ctx: Context, namespace: str, entries: list[ClassEntry]) -> JudgedClasses:
    """Verdicts for the namespace's classes; reads the Secrets they reference."""
    views = [e.view for e in entries]
    refs = {name for v in views if v.spec for name in v.spec.secret_names()}
    secrets = {ref: secret_hashes(ctx, namespace, ref) for ref in sorted(refs)}
    return JudgedClasses(views, secrets, judge_classes(views, secrets))


def verdict_patch(
    status: Mapping[str, Any], entry: ClassEntry, verdict: Verdict, now: str
) -> dict[str, Any] | None:
    """The status merge patch that puts ``verdict`` and its Ready condition
    (:mod:`..classstatus`) into ``status``, or None when they are there already. The
    conditions list is sent whole (a merge patch replaces lists): the Degraded condition
    is the attainment job's and goes back as ``status`` has it."""
    previous: SLOClassStatus = parse_status(SLOClassStatus, dict(status))
    ready = ready_condition(
        verdict.accepted, verdict.reason, verdict.message, entry.view.generation
    )
    wanted = previous.model_copy(
        update={
            "accepted": verdict.accepted,
            "reason": verdict.reason,
            "message": verdict.message,
            "observed_generation": entry.view.generation,
            "conditions": set_condition(previous.conditions, ready, now),
        }
    )
    if wanted.wire() == previous.wire():
        return None
    fields = ("accepted", "reason", "message", "observedGeneration", "conditions")
    return {"status": {k: v for k, v in wanted.wire().items() if k in fields}}


def write_verdict(ctx: Context, entry: ClassEntry, verdict: Verdict) -> bool:
    """Patch the verdict into the class's status unless it is there already; True if
    written. The patch is computed from the live object, not the index's copy, and sent
    with its resourceVersion (:func:`..statuspatch.patch_status`): an attainment write in
    between is a 409 and a fresh read, never a Degraded condition put back as it was.
    Deciding from the live status also covers an index copy that lags behind our own
    last write of the class; a sync runs only when a class's spec or labels change (or
    one failed), so these reads are rare."""
    meta, now = entry.ref["metadata"], now_rfc3339()
    return patch_status(
        ctx.kube,
        "SLOClass",
        meta["namespace"],
        meta["name"],
        lambda status: verdict_patch(status, entry, verdict, now),
    )


def sync_classes(
    ctx: Context,
    synced: ClassSync,
    namespace: str,
    entries: list[ClassEntry],
    pools: dict[str, list[PoolRef]],
) -> list[tuple[ClassEntry, Event]]:
    """Judge the classes, write their verdicts, rewrite every service's SLO table
    (``pools``: service -> its pools); returns the Events to post. A no-op when these
    inputs were synced already."""
    with ctx.locks("classes", namespace):
        if synced.is_current(namespace, entries):
            return []
        judged = judge(ctx, namespace, entries)
        events = []
        for entry in entries:
            verdict = judged.verdicts.get(entry.name)
            if verdict and write_verdict(ctx, entry, verdict) and not verdict.accepted:
                events.append((entry, Event("Warning", verdict.reason, verdict.message)))
        for service, service_pools in sorted(pools.items()):
            sync_gateway(ctx, namespace, service, service_pools, judged)
        synced.record(namespace, entries)
    return events


def _sync(
    memo: kopf.Memo, namespace: str, classes_by_namespace: ClassIndex, pools_by_service: PoolIndex
) -> None:
    synced = from_memo(memo, "class_sync", ClassSync)
    entries = classes_of(classes_by_namespace, namespace)
    if synced.is_current(namespace, entries):
        return  # e.g. the event of our own status write
    pools = {
        service: pools_of(pools_by_service, namespace, service)
        for service in services_of(pools_by_service, namespace)
    }
    try:
        events = sync_classes(context(memo), synced, namespace, entries, pools)
    except ApiError as e:
        log.warning("SLO class sync in %s failed (a pool timer repeats it): %s", namespace, e)
        return
    for entry, event in events:
        post(dict(entry.ref), [event])


@kopf.on.event(*CLASSES)
def sloclass_changed(namespace: str | None, memo: kopf.Memo, **kwargs: Any) -> None:
    """Any change of a class's spec or labels, or a deletion: sync its namespace."""
    if namespace is not None:
        _sync(memo, namespace, class_index(kwargs), pool_index(kwargs))


@kopf.timer(*POOLS, id="sloclass-resync", interval=SETTINGS.reconcile_interval_s, initial_delay=1.0)
def resync_classes(namespace: str | None, memo: kopf.Memo, **kwargs: Any) -> None:
    """Repeat a failed or missed sync of the pool's namespace (a no-op when current)."""
    if namespace is not None:
        _sync(memo, namespace, class_index(kwargs), pool_index(kwargs))
