"""kopf indexes of the custom resources: the operator's in-memory view of the cluster.

kopf fills them from its watch streams before any handler runs (and after every event,
before that event's handlers), so a handler reads the pools of a service or the classes of
a namespace without a list call. The values are parsed models: an invalid or deleting
pool is not indexed, so it contributes no endpoints to its service's gateway.

A handler receives an index as the keyword argument named after the index function
(``pools_by_service``, ``classes_by_namespace``); kopf's handler protocols do not declare
those, so handlers take them from ``**kwargs`` with :func:`pool_index` and
:func:`class_index`. Sync handlers run in threads while kopf
updates the indexes on its event loop: read them only through the snapshot functions
below. They copy a store in one C-level step; should the event loop add or drop an entry
between creating the iterator and copying (``RuntimeError: changed size during
iteration``), they copy again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import kopf
from pydantic import ValidationError

from ..builders import PoolRef, SLOClassView
from ..models import ServingPoolSpec, SLOClassSpec
from ..models.gateway import pool_name_problem
from .common import CLASSES, POOLS, validation_message

ServiceKey = tuple[str, str]  # (namespace, service)
PoolIndex = kopf.Index[ServiceKey, PoolRef]
V = TypeVar("V")


@dataclass(frozen=True)
class ClassEntry:
    """One SLOClass as indexed: the builders' view, plus what posting and status need."""

    view: SLOClassView
    ref: Mapping[str, Any]  # apiVersion, kind, metadata (name, namespace, uid): for Events
    status: Mapping[str, Any] = field(default_factory=dict)  # as last seen, to skip no-ops

    @property
    def name(self) -> str:
        return self.view.name


ClassIndex = kopf.Index[str, ClassEntry]


@kopf.index(*POOLS)
def pools_by_service(
    body: kopf.Body, name: str, namespace: str | None, uid: str | None, **_: Any
) -> dict[ServiceKey, PoolRef]:
    """(namespace, service) -> the valid, live pools of that service."""
    if namespace is None or uid is None or body.get("metadata", {}).get("deletionTimestamp"):
        return {}  # an empty mapping removes the pool from every key
    try:
        spec = ServingPoolSpec.model_validate(dict(body.get("spec") or {}))
    except ValidationError:
        return {}
    if pool_name_problem(name):
        return {}  # its Service's name would not fit (reconcile_pool reports it)
    return {(namespace, spec.service): PoolRef(name, namespace, uid, spec)}


@kopf.index(*CLASSES)
def classes_by_namespace(
    body: kopf.Body, name: str, namespace: str | None, **_: Any
) -> dict[str, ClassEntry]:
    """namespace -> its SLOClasses (an invalid spec is kept, with the reason, to be judged)."""
    if namespace is None:
        return {}
    meta = body.get("metadata", {})
    spec: SLOClassSpec | None
    try:
        spec, error = SLOClassSpec.model_validate(dict(body.get("spec") or {})), None
    except ValidationError as e:
        spec, error = None, validation_message(e)
    view = SLOClassView(
        name=name,
        labels=dict(meta.get("labels") or {}),
        created=meta.get("creationTimestamp", ""),
        generation=meta.get("generation"),
        spec=spec,
        error=error,
    )
    ref = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {"name": name, "namespace": namespace, "uid": meta.get("uid")},
    }
    return {namespace: ClassEntry(view, ref, dict(body.get("status") or {}))}


def pool_index(kwargs: Mapping[str, Any]) -> PoolIndex:
    """The ``pools_by_service`` index from a handler's keyword arguments."""
    return cast(PoolIndex, kwargs["pools_by_service"])


def class_index(kwargs: Mapping[str, Any]) -> ClassIndex:
    """The ``classes_by_namespace`` index from a handler's keyword arguments."""
    return cast(ClassIndex, kwargs["classes_by_namespace"])


def _copy(items: Callable[[], Iterable[V]]) -> list[V]:
    for _ in range(10):
        try:
            return list(items())
        except RuntimeError:  # changed size during iteration: the loop thread wrote
            continue
    return list(items())


def pools_of(index: PoolIndex, namespace: str, service: str) -> list[PoolRef]:
    """The service's pools, by name."""
    store = index.get((namespace, service))
    return sorted(_copy(lambda: store or ()), key=lambda p: p.name)


def services_of(index: PoolIndex, namespace: str) -> list[str]:
    """Services with at least one valid pool in the namespace, by name."""
    return sorted(service for ns, service in _copy(lambda: index) if ns == namespace)


def classes_of(index: ClassIndex, namespace: str) -> list[ClassEntry]:
    """The namespace's SLOClasses, by name."""
    store = index.get(namespace)
    return sorted(_copy(lambda: store or ()), key=lambda c: c.name)
