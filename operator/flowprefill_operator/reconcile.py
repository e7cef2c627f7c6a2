"""The reconcile procedures: read, build (pure), apply, fold status. No kopf in here.

Every procedure is level-based: it reads the current state and converges to the desired
one, so running it twice, or after a restart, changes nothing that is already right.
Kubernetes Events to post are returned as data; the kopf handlers post them.
"""

from __future__ import annotations

import base64
import binascii
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from . import MANAGED_BY
from .attainment import AttainmentTracker, fetch_text, scrape
from .builders import (
    PoolRef,
    SLOClassView,
    Verdict,
    build_gateway_children,
    build_pool_children,
    build_slo_table,
    gateway_name,
    gateway_url,
    judge_classes,
    pool_selector,
    selector_string,
    sha256_hex,
    slo_table_name,
)
from .builders.common import ROLE_LABEL
from .builders.pool import engine_configmap_name
from .kube import Kube
from .models import ServingPoolSpec, ServingPoolStatus, SLOClassSpec, SLOClassStatus
from .settings import OperatorSettings
from .status import Observed, Problem, fold_status

Body = dict[str, Any]


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class PoolResult:
    status: ServingPoolStatus
    changed: bool
    invalid: str | None = None
    events: list[Event] = field(default_factory=list)


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        parts.append(f"spec.{loc}: {e['msg']}" if loc else f"spec: {e['msg']}")
    return "; ".join(parts)


def parse_status(model: type[BaseModel], raw: dict[str, Any] | None) -> Any:
    """Previous status, ignoring fields this version does not know (or garbled ones)."""
    known = {f.alias or n for n, f in model.model_fields.items()}
    try:
        return model.model_validate({k: v for k, v in (raw or {}).items() if k in known})
    except ValidationError:
        return model()


class KeyedLocks:
    """One lock per key: a timer and a watch handler never reconcile one object at once."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, ...], threading.Lock] = {}

    @contextmanager
    def __call__(self, *key: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            yield


def status_events(before: ServingPoolStatus, after: ServingPoolStatus) -> list[Event]:
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


class Reconciler:
    def __init__(self, kube: Kube, settings: OperatorSettings) -> None:
        self.kube = kube
        self.settings = settings
        self.tracker = AttainmentTracker(settings.attainment_window_s)
        self.locks = KeyedLocks()

    # ---- ServingPool -------------------------------------------------------------------

    def reconcile_pool(self, body: Body) -> PoolResult:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        with self.locks("pool", namespace, name):
            return self._reconcile_pool(body, namespace, name)

    def _reconcile_pool(self, body: Body, namespace: str, name: str) -> PoolResult:
        meta = body["metadata"]
        generation = meta.get("generation")
        previous: ServingPoolStatus = parse_status(ServingPoolStatus, body.get("status"))
        raw_spec = body.get("spec") or {}
        selector = selector_string(pool_selector(name))
        try:
            spec = ServingPoolSpec.model_validate(raw_spec)
        except ValidationError as e:
            message = validation_message(e)
            replicas = raw_spec.get("replicas")
            observed = Observed(
                generation=generation,
                desired_replicas=replicas if isinstance(replicas, int) else 0,
                deployment=self.kube.get("Deployment", namespace, name),
                problems=[Problem("InvalidSpec", message, invalid_spec=True)],
            )
            status = fold_status(observed, previous, now_rfc3339(), selector=selector, gateway="")
            return self._write_pool_status(namespace, name, previous, status, invalid=message)

        pool = PoolRef(name=name, namespace=namespace, uid=meta["uid"], spec=spec)
        problems = self._preflight(pool)
        for manifest in build_pool_children(pool, self.settings):
            self.kube.apply(manifest)
        self.sync_gateway(namespace, spec.service)
        observed = Observed(
            generation=generation,
            desired_replicas=spec.replicas,
            deployment=self.kube.get("Deployment", namespace, name),
            pods=self.kube.list("Pod", namespace, pool_selector(name)),
            problems=problems,
        )
        status = fold_status(
            observed,
            previous,
            now_rfc3339(),
            selector=selector,
            gateway=gateway_url(spec.service, namespace, self.settings),
        )
        return self._write_pool_status(namespace, name, previous, status)

    def _write_pool_status(
        self,
        namespace: str,
        name: str,
        previous: ServingPoolStatus,
        status: ServingPoolStatus,
        invalid: str | None = None,
    ) -> PoolResult:
        changed = status.wire() != previous.wire()
        if changed:
            self.kube.patch("ServingPool", namespace, name, {"status": status.wire()}, sub="status")
        return PoolResult(status, changed, invalid, status_events(previous, status))

    def _preflight(self, pool: PoolRef) -> list[Problem]:
        """References that must exist for the pods to start (checked, not waited for)."""
        problems = []
        spec, ns = pool.spec, pool.namespace
        if spec.model.pvc and not self.kube.get(
            "PersistentVolumeClaim", ns, spec.model.pvc.claim_name
        ):
            problems.append(
                Problem("ModelVolumeNotFound", f"PVC {spec.model.pvc.claim_name!r} not found")
            )
        kv = spec.kv_handoff
        if kv and kv.claim_name and not self.kube.get("PersistentVolumeClaim", ns, kv.claim_name):
            problems.append(Problem("KVVolumeNotFound", f"PVC {kv.claim_name!r} not found"))
        problems += self._kv_mismatch(pool)
        profile = spec.engine.ttft_profile if spec.engine else None
        if profile:
            cm = self.kube.get("ConfigMap", ns, profile.name)
            if cm is None:
                problems.append(Problem("ProfileNotFound", f"ConfigMap {profile.name!r} not found"))
            elif profile.key not in (cm.get("data") or {}):
                problems.append(
                    Problem("ProfileNotFound", f"ConfigMap {profile.name!r} has no {profile.key!r}")
                )
        return problems

    def _kv_mismatch(self, pool: PoolRef) -> list[Problem]:
        """The service's pools of the other role must hand KV off the same way, or decode
        silently recomputes every prompt (the hand-off never arrives)."""

        def describe(p: PoolRef) -> str:
            kv = p.spec.kv_handoff
            if kv is None:
                return "no kvHandoff"
            return f"kvHandoff {kv.transport}" + (f" ({kv.claim_name})" if kv.claim_name else "")

        def key(p: PoolRef) -> tuple[str, str | None] | None:
            return p.spec.kv_handoff.key() if p.spec.kv_handoff else None

        others = [
            p
            for p in self._pools_of(pool.namespace, pool.spec.service, exclude=pool.name)
            if p.spec.role != pool.spec.role and key(p) != key(pool)
        ]
        if not others:
            return []
        theirs = ", ".join(f"{p.spec.role} pool {p.name!r} has {describe(p)}" for p in others)
        return [Problem("KVHandoffMismatch", f"this pool has {describe(pool)} but {theirs}")]

    def delete_pool(self, body: Body) -> None:
        """Remove the pool's children now (the GC would too, via owner references)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        with self.locks("pool", namespace, name):
            self.kube.delete("Deployment", namespace, name)
            self.kube.delete("Service", namespace, name)
            self.kube.delete("ConfigMap", namespace, engine_configmap_name(name))
        service = (body.get("spec") or {}).get("service")
        if isinstance(service, str):
            self.sync_gateway(namespace, service, exclude=name)

    # ---- Gateway and SLO table -----------------------------------------------------------

    def _pools_of(self, namespace: str, service: str, exclude: str | None) -> list[PoolRef]:
        pools = []
        for obj in self.kube.list("ServingPool", namespace):
            meta = obj["metadata"]
            if meta["name"] == exclude or meta.get("deletionTimestamp"):
                continue
            try:
                spec = ServingPoolSpec.model_validate(obj.get("spec") or {})
            except ValidationError:
                continue  # an invalid pool contributes no endpoints
            if spec.service == service:
                pools.append(PoolRef(meta["name"], namespace, meta["uid"], spec))
        return pools

    def sync_gateway(self, namespace: str, service: str, exclude: str | None = None) -> None:
        with self.locks("gateway", namespace, service):
            pools = self._pools_of(namespace, service, exclude)
            if not pools:
                for kind, child in (
                    ("Deployment", gateway_name(service)),
                    ("Service", gateway_name(service)),
                    ("ConfigMap", gateway_name(service)),
                    ("ConfigMap", slo_table_name(service)),
                ):
                    self.kube.delete(kind, namespace, child)
                return
            views, secrets = self._class_views(namespace)
            verdicts = judge_classes(views, secrets)
            selectors = [p.spec.slo_class_selector for p in pools]
            table = build_slo_table(views, selectors, verdicts, secrets)
            for manifest in build_gateway_children(pools, table, self.settings):
                self.kube.apply(manifest)

    # ---- SLOClass ------------------------------------------------------------------------

    def _class_views(
        self, namespace: str
    ) -> tuple[list[SLOClassView], dict[str, list[str] | None]]:
        views = []
        for obj in self.kube.list("SLOClass", namespace):
            meta = obj["metadata"]
            spec: SLOClassSpec | None
            try:
                spec, error = SLOClassSpec.model_validate(obj.get("spec") or {}), None
            except ValidationError as e:
                spec, error = None, validation_message(e)
            views.append(
                SLOClassView(
                    name=meta["name"],
                    labels=meta.get("labels") or {},
                    created=meta.get("creationTimestamp", ""),
                    generation=meta.get("generation"),
                    spec=spec,
                    error=error,
                )
            )
        refs = {
            v.spec.match.api_key_secret_ref.name
            for v in views
            if v.spec and v.spec.match.api_key_secret_ref
        }
        return views, {ref: self._secret_hashes(namespace, ref) for ref in sorted(refs)}

    def _secret_hashes(self, namespace: str, name: str) -> list[str] | None:
        secret = self.kube.get("Secret", namespace, name)
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

    def sync_classes(self, namespace: str) -> list[tuple[Body, Event]]:
        """Acceptance of every class in the namespace, then every service's SLO table."""
        with self.locks("classes", namespace):
            views, secrets = self._class_views(namespace)
            verdicts = judge_classes(views, secrets)
            events = []
            for obj in self.kube.list("SLOClass", namespace):
                verdict = verdicts.get(obj["metadata"]["name"])
                if (
                    verdict is not None
                    and self._write_verdict(obj, verdict)
                    and not verdict.accepted
                ):
                    events.append((obj, Event("Warning", verdict.reason, verdict.message)))
        services = set()
        for obj in self.kube.list("ServingPool", namespace):
            service = (obj.get("spec") or {}).get("service")
            if isinstance(service, str) and not obj["metadata"].get("deletionTimestamp"):
                services.add(service)
        for service in sorted(services):
            self.sync_gateway(namespace, service)
        return events

    def _write_verdict(self, obj: Body, verdict: Verdict) -> bool:
        meta = obj["metadata"]
        previous: SLOClassStatus = parse_status(SLOClassStatus, obj.get("status"))
        wanted = previous.model_copy(
            update={
                "accepted": verdict.accepted,
                "reason": verdict.reason,
                "message": verdict.message,
                "observed_generation": meta.get("generation"),
            }
        )
        if wanted.wire() == previous.wire():
            return False
        patch = {
            "status": {
                k: v
                for k, v in wanted.wire().items()
                if k in ("accepted", "reason", "message", "observedGeneration")
            }
        }
        self.kube.patch("SLOClass", meta["namespace"], meta["name"], patch, sub="status")
        return True

    # ---- Attainment ----------------------------------------------------------------------

    def gateway_targets(self, namespace: str) -> dict[str, str]:
        """pod -> metrics URL of every running gateway pod in the namespace."""
        labels = {"app.kubernetes.io/managed-by": MANAGED_BY, ROLE_LABEL: "gateway"}
        targets = {}
        for pod in self.kube.list("Pod", namespace, labels):
            status = pod.get("status") or {}
            ip = status.get("podIP")
            if status.get("phase") != "Running" or not ip:
                continue
            port = 8000
            for container in pod.get("spec", {}).get("containers", []):
                for p in container.get("ports", []):
                    if p.get("name") == "http":
                        port = int(p["containerPort"])
            targets[pod["metadata"]["name"]] = f"http://{ip}:{port}/metrics"
        return targets

    def refresh_attainment(self, namespace: str) -> dict[str, str]:
        """Scrape the namespace's gateways unless a recent scrape exists; returns errors."""
        with self.locks("scrape", namespace):
            last = self.tracker.last_time(namespace)
            now = time.monotonic()
            if last is not None and now - last < self.settings.attainment_interval_s / 2:
                return {}
            timeout = self.settings.scrape_timeout_s
            sample, errors = scrape(
                self.gateway_targets(namespace), lambda url: fetch_text(url, timeout)
            )
            self.tracker.record(namespace, now, sample)
            return errors

    def write_attainment(self, namespace: str) -> int:
        """Fold the window's counts into every SLOClass of the namespace; returns writes."""
        self.refresh_attainment(namespace)
        if self.tracker.sample_count(namespace) < 2:
            return 0  # not enough samples for a window yet
        window = self.tracker.window(namespace)
        writes = 0
        for obj in self.kube.list("SLOClass", namespace):
            name = obj["metadata"]["name"]
            att = window.get(name)
            fields = {
                "attainment": round(att.fraction, 4) if att and att.fraction is not None else None,
                "requestCount": att.requests if att else 0,
                "windowSeconds": int(self.settings.attainment_window_s),
            }
            current = obj.get("status") or {}
            if all(current.get(k) == v for k, v in fields.items()):
                continue
            self.kube.patch("SLOClass", namespace, name, {"status": fields}, sub="status")
            writes += 1
        return writes
