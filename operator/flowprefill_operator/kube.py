"""A small JSON-over-REST layer on the official client: get, list, create, patch, apply.

Manifests stay plain dicts end to end (the builders' output), so no typed models are
converted back and forth. Writes are JSON merge patches, never replaces.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

import urllib3
from kubernetes import client, config

from . import API_VERSION
from .diff import MANAGED_BY_LABEL, last_applied, owned, plan_patch, with_last_applied

log = logging.getLogger(__name__)

# kind -> (API prefix, plural)
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Event": ("/api/v1", "events"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Pod": ("/api/v1", "pods"),
    "Secret": ("/api/v1", "secrets"),
    "Service": ("/api/v1", "services"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    # The gateway's optional children (builders/gateway_ha.py).
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "HTTPRoute": ("/apis/gateway.networking.k8s.io/v1", "httproutes"),
    "ServingPool": (f"/apis/{API_VERSION}", "servingpools"),
    "SLOClass": (f"/apis/{API_VERSION}", "sloclasses"),
}
TRANSIENT = {0, 408, 409, 429, 500, 502, 503, 504}
MERGE_PATCH = "application/merge-patch+json"

Outcome = Literal["created", "patched", "unchanged"]


class ApiError(Exception):
    """A failed API request; ``transient`` ones are worth retrying with backoff."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def transient(self) -> bool:
        return self.status in TRANSIENT


class NotOwned(Exception):
    """A same-named object exists that the operator did not make: it is left alone."""

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        super().__init__(
            f"{kind} {namespace}/{name} exists and is not managed by the operator "
            f"(no {MANAGED_BY_LABEL} label or ownerReference of ours): left as it is; "
            "rename or delete it"
        )
        self.kind = kind
        self.namespace = namespace
        self.name = name


def load_client() -> client.ApiClient:
    """In-cluster service account if present, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _path(kind: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    if name:
        path += f"/{name}" + (f"/{sub}" if sub else "")
    return path


class Kube:
    """Synchronous; kopf runs sync handlers in its thread pool."""

    def __init__(self, api: client.ApiClient, timeout_s: float = 10.0) -> None:
        self.api = api
        self.timeout_s = timeout_s

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        method_, url, headers_, body_, post = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            resp = self.api.call_api(
                method_, url, header_params=headers_, body=body_, post_params=post,
                _request_timeout=self.timeout_s,
            )  # fmt: skip
            data = resp.read()
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise ApiError(0, "ConnectionError", str(e)) from e
        payload = json.loads(data) if data else None
        if resp.status >= 400:
            detail = payload if isinstance(payload, dict) else {}
            raise ApiError(
                resp.status, str(detail.get("reason", resp.reason)), str(detail.get("message", ""))
            )
        return payload

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self.request("GET", _path(kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        return obj

    def list(
        self, kind: str, namespace: str | None, labels: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())} if labels else {}
        items: list[dict[str, Any]] = self.request("GET", _path(kind, namespace), query=query)[
            "items"
        ]
        # Filter again client-side: cheap, and correct even where selectors are ignored.
        want = labels or {}
        return [
            item
            for item in items
            if all(item.get("metadata", {}).get("labels", {}).get(k) == v for k, v in want.items())
        ]

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        created: dict[str, Any] = self.request(
            "POST", _path(manifest["kind"], meta.get("namespace")), manifest
        )
        return created

    def patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        patched: dict[str, Any] = self.request(
            "PATCH", _path(kind, namespace, name, sub), patch, content_type=MERGE_PATCH
        )
        return patched

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete (background propagation); False if it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            self.request("DELETE", _path(kind, namespace, name), body)
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    def delete_managed(self, kind: str, namespace: str, name: str, managed_by: str) -> bool:
        """Delete the object only if it carries our managed-by label (a same-named object
        someone else made stays); False if it was gone or not ours."""
        live = self.get(kind, namespace, name)
        if live is None:
            return False
        if (live.get("metadata", {}).get("labels") or {}).get(MANAGED_BY_LABEL) != managed_by:
            log.warning("not deleting %s %s/%s: not managed by the operator", kind, namespace, name)
            return False
        return self.delete(kind, namespace, name)

    def apply(self, manifest: dict[str, Any]) -> Outcome:
        """Create the object, or merge-patch the fields that differ (compared semantically,
        see :mod:`.diff`); no write when in sync. Raises :class:`NotOwned` (no write) when a
        same-named object exists that the operator did not make, :class:`ApiError` when
        the API server refuses."""
        desired = with_last_applied(manifest)
        meta = desired["metadata"]
        live = self.get(desired["kind"], meta["namespace"], meta["name"])
        if live is not None and not owned(live, desired):
            raise NotOwned(desired["kind"], meta["namespace"], meta["name"])
        if live is None:
            self.create(desired)
            log.info("created %s %s/%s", desired["kind"], meta["namespace"], meta["name"])
            return "created"
        patch = plan_patch(desired, live, last_applied(live))
        if not patch:
            return "unchanged"
        self.patch(desired["kind"], meta["namespace"], meta["name"], patch)
        log.info("patched %s %s/%s", desired["kind"], meta["namespace"], meta["name"])
        return "patched"
