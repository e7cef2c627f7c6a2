"""Attainment controller: scrapes the gateways' SLO counters and writes each SLOClass's
observed attainment over the window (status ``attainment``, ``requestCount``,
``shedCount``, ``windowSeconds``, ``attainmentTime`` and the ``Degraded`` condition,
written with optimistic concurrency beside the class sync's ``Ready``); it owns the
:class:`~flowprefill_operator.attainment.AttainmentTracker` (kept in kopf's memo; the
autoscaler reads its windows too) and only those status fields.

Gateways exist only where pools do, so the job runs on a timer of the pools (SLOClasses
then need no timer and no finalizer), rate-limited to one scrape per namespace per half
interval however many pools the namespace has. Each namespace's newest scrape is also
kept with its wall-clock time (:class:`LatestScrapes`): the autoscaler folds it into the
pools' persisted histories (``flowprefill_operator.history``), which outlive this process
and so cannot use the tracker's monotonic clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kopf

from flowprefill.contracts.deployment import GATEWAY_PORT, METRICS_PATH

from .. import MANAGED_BY
from ..attainment import AttainmentTracker, Sample, fetch_text, scrape
from ..builders.common import ROLE_LABEL, SERVICE_LABEL
from ..classstatus import attainment_patch
from ..kube import ApiError
from ..statuspatch import patch_status
from .common import POOLS, SETTINGS, Context, context, from_memo
from .indexes import ClassEntry, class_index, classes_of

log = logging.getLogger(__name__)


def gateway_targets(ctx: Context, namespace: str) -> tuple[dict[str, str], dict[str, str]]:
    """pod -> metrics URL of every running gateway pod in the namespace, and pod -> the
    service it is the gateway of."""
    labels = {"app.kubernetes.io/managed-by": MANAGED_BY, ROLE_LABEL: "gateway"}
    targets, services = {}, {}
    for pod in ctx.kube.list("Pod", namespace, labels):
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if status.get("phase") != "Running" or not ip:
            continue
        port = GATEWAY_PORT  # unless the pod names its http port
        for container in pod.get("spec", {}).get("containers", []):
            for p in container.get("ports", []):
                if p.get("name") == "http":
                    port = int(p["containerPort"])
        name = pod["metadata"]["name"]
        targets[name] = f"http://{ip}:{port}{METRICS_PATH}"
        services[name] = str(pod["metadata"].get("labels", {}).get(SERVICE_LABEL, ""))
    return targets, services


@dataclass(frozen=True)
class Scrape:
    """One scrape of a namespace's gateways: wall-clock time, pod -> counters, pod -> the
    service it is the gateway of. A pod that did not answer is absent."""

    wall_s: float
    sample: Sample
    services: dict[str, str]


class LatestScrapes:
    """The newest :class:`Scrape` of each namespace (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[str, Scrape] = {}

    def record(self, namespace: str, scraped: Scrape) -> None:
        with self._lock:
            self._latest[namespace] = scraped

    def get(self, namespace: str) -> Scrape | None:
        with self._lock:
            return self._latest.get(namespace)


def refresh_attainment(
    ctx: Context,
    tracker: AttainmentTracker,
    namespace: str,
    latest: LatestScrapes | None = None,
) -> dict[str, str]:
    """Scrape the namespace's gateways unless a recent scrape exists; returns errors. The
    scrape goes to ``tracker`` and, with its wall-clock time, to ``latest``."""
    with ctx.locks("scrape", namespace):
        last = tracker.last_time(namespace)
        now = time.monotonic()
        if last is not None and now - last < ctx.settings.attainment_interval_s / 2:
            return {}
        timeout = ctx.settings.scrape_timeout_s
        targets, services = gateway_targets(ctx, namespace)
        sample, errors = scrape(targets, lambda url: fetch_text(url, timeout))
        tracker.record(namespace, now, sample, services)
        if latest is not None:
            latest.record(namespace, Scrape(time.time(), sample, services))
        return errors


def write_attainment(
    ctx: Context,
    tracker: AttainmentTracker,
    namespace: str,
    classes: list[ClassEntry],
    latest: LatestScrapes | None = None,
) -> int:
    """Fold the window's counts into every class of the namespace, with its Degraded
    condition, at the rate :mod:`..classstatus` states; returns the writes."""
    refresh_attainment(ctx, tracker, namespace, latest)
    if tracker.sample_count(namespace) < 2:
        return 0  # not enough samples for a window yet
    window = tracker.window(namespace)
    writes = 0
    for entry in classes:
        att = window.get(entry.name)
        fields = {
            "attainment": round(att.fraction, 4) if att and att.fraction is not None else None,
            "requestCount": att.requests if att else 0,
            "shedCount": round(att.shed) if att else 0,
            "windowSeconds": int(ctx.settings.attainment_window_s),
        }
        writes += write_class_attainment(ctx, namespace, entry, fields)
    return writes


def write_class_attainment(
    ctx: Context, namespace: str, entry: ClassEntry, fields: dict[str, Any]
) -> bool:
    """Write one class's window ``fields`` with its Degraded condition if the write-rate
    rule (:func:`..classstatus.attainment_patch`) says so; True if written.

    The index's copy of the status decides whether to look at all (the common case every
    interval: nothing due, no request). When a write is due, the patch is computed again
    from the live object and sent with its resourceVersion
    (:func:`..statuspatch.patch_status`), so that the conditions list it carries has the
    class sync's current Ready condition, not the index's possibly older one."""
    spec, now = entry.view.spec, datetime.now(UTC)
    target = spec.attainment_target if spec else None

    def patch(status: Mapping[str, Any]) -> dict[str, Any] | None:
        return attainment_patch(status, fields, target, entry.view.generation, now)

    if patch(entry.status) is None:
        return False  # unchanged, or a small change written recently (classstatus' rule)
    return patch_status(ctx.kube, "SLOClass", namespace, entry.name, patch)


@kopf.timer(*POOLS, id="attainment", interval=SETTINGS.attainment_interval_s, initial_delay=1.0)
def attainment(body: kopf.Body, namespace: str | None, memo: kopf.Memo, **kwargs: Any) -> None:
    if namespace is None or body.get("metadata", {}).get("deletionTimestamp"):
        return
    tracker = from_memo(memo, "attainment", AttainmentTracker)
    latest = from_memo(memo, "latest_scrapes", LatestScrapes)
    classes = classes_of(class_index(kwargs), namespace)
    try:
        write_attainment(context(memo), tracker, namespace, classes, latest)
    except ApiError as e:
        log.warning("attainment of %s not written (the next run retries): %s", namespace, e)
