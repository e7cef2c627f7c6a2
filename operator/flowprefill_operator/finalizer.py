"""kopf's finalizer on ServingPools: its name and the one way to release it.

kopf puts :data:`FINALIZER` (``settings.persistence.finalizer``, set in ``handlers``) on
every pool it runs timers on; it guards only that process's timers. Two callers release
it: the operator on a graceful exit (``controllers.servingpool.release_finalizers``) and
the chart's pre-delete hook once the operator is gone (``stop``), so that a pool deleted
after ``helm uninstall`` does not hang in Terminating.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import GROUP
from .kube import ApiError, Kube

FINALIZER = f"{GROUP}/finalizer"


def release_finalizer(kube: Kube, namespace: str, name: str, finalizer: str = FINALIZER) -> bool:
    """Remove ``finalizer`` from one pool (others' finalizers stay); True if it was there.
    The resourceVersion in the patch makes a concurrent finalizer change a 409, not a loss."""
    live = kube.get("ServingPool", namespace, name)
    finalizers = list((live or {}).get("metadata", {}).get("finalizers") or [])
    if live is None or finalizer not in finalizers:
        return False
    rest = [f for f in finalizers if f != finalizer]
    version = live["metadata"]["resourceVersion"]
    patch = {"metadata": {"finalizers": rest or None, "resourceVersion": version}}
    kube.patch("ServingPool", namespace, name, patch)
    return True


@dataclass
class Released:
    """What :func:`release_all` did in one namespace (``None``: every namespace)."""

    released: list[str] = field(default_factory=list)  # pool names
    errors: list[str] = field(default_factory=list)  # "name: API error", or the list's error


def release_all(
    kube: Kube, namespaces: list[str] | None, finalizer: str = FINALIZER
) -> dict[str | None, Released]:
    """Release ``finalizer`` from every pool in ``namespaces`` (``None``: one cluster-wide
    list). Best effort: an API error is recorded for its pool (or namespace) and the rest
    go on; pools without the finalizer are left untouched. Keyed by namespace; a
    cluster-wide call reports under each pool's own namespace."""
    report: dict[str | None, Released] = {}
    for scope in namespaces if namespaces is not None else [None]:
        try:
            pools = kube.list("ServingPool", scope)
        except ApiError as e:
            report.setdefault(scope, Released()).errors.append(f"list: {e}")
            continue
        if scope is not None:
            report.setdefault(scope, Released())
        for pool in pools:
            meta = pool["metadata"]
            namespace, name = meta["namespace"], meta["name"]
            entry = report.setdefault(namespace, Released())
            if finalizer not in (meta.get("finalizers") or []):
                continue
            try:
                if release_finalizer(kube, namespace, name, finalizer):
                    entry.released.append(name)
            except ApiError as e:
                entry.errors.append(f"{name}: {e}")
    return report
