"""The kopf entry point: ``kopf run -m flowprefill_operator.handlers --all-namespaces``
(or ``-n NS`` ...), with ``--liveness=http://0.0.0.0:8080/healthz`` for the probe.

Importing this module registers every controller's handlers and indexes (see
``controllers``); here are only the operator-wide pieces: kopf's settings, the shared
state put into kopf's memo at startup, and the liveness probe.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import kopf

from . import GROUP
from .attainment import AttainmentTracker
from .controllers import autoscaler, indexes, scraper, servingpool, sloclass  # noqa: F401
from .controllers.autoscaler import Histories, ScalerRounds
from .controllers.common import SETTINGS, Context, Health, KeyedLocks, health, now_rfc3339
from .controllers.scraper import LatestScrapes
from .controllers.sloclass import ClassSync
from .finalizer import FINALIZER
from .kube import Kube, load_client
from .metrics import OperatorMetrics


def peering_priority(pod_name: str) -> int:
    """Distinct per replica: kopf freezes peers of equal priority, the highest one runs."""
    return int(hashlib.sha256(pod_name.encode()).hexdigest()[:7], 16)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's settings, and the state every controller shares (the memo's objects are
    shared by the per-object copies kopf makes of it)."""
    # kopf's own finalizer, only there while a process runs timers on the pool: released on
    # a graceful exit (controllers.servingpool.release_finalizers), and by the chart's
    # pre-delete hook once the operator is gone (stop.py), so uninstalling before deleting
    # the pools hangs nothing. The name is the one earlier versions used, so the
    # finalizer existing pools carry is the one kopf manages and releases.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # our own events only, not every handler run
    settings.networking.request_timeout = SETTINGS.api_timeout_s * 3
    settings.watching.server_timeout = 300
    settings.peering.priority = peering_priority(os.environ.get("POD_NAME", "") or "standalone")
    # Namespaced (the chart's Roles grant nothing cluster-wide): kopf would retry the
    # forbidden namespace list and CRD watch 9 times, about a minute, before falling back
    # to the namespaces given and the resources found at start, which this asks at once.
    settings.scanning.disabled = SETTINGS.watch_scope == "namespaced"
    memo.context = Context(Kube(load_client(), SETTINGS.api_timeout_s), SETTINGS, KeyedLocks())
    memo.class_sync = ClassSync()
    memo.attainment = AttainmentTracker(SETTINGS.attainment_window_s)
    memo.scaler_rounds = ScalerRounds()
    memo.latest_scrapes = LatestScrapes()
    memo.autoscaler_histories = Histories()
    memo.operator_metrics = OperatorMetrics()
    memo.operator_metrics.serve(SETTINGS.metrics_port)
    memo.health = Health(started=now_rfc3339())


@kopf.on.probe(id="reconciler")
def probe(memo: kopf.Memo, **_: Any) -> str:
    """When a pool was last reconciled (or the operator started, before the first)."""
    state = health(memo)
    return state.last_reconcile or state.started
