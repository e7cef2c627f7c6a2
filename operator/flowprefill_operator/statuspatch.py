"""Status writes that cannot lose a concurrent writer's change: optimistic concurrency.

Two controllers write parts of one SLOClass status: the class sync its verdict and the
``Ready`` condition, the attainment job the window's numbers and ``Degraded``. A JSON
merge patch replaces a list as a whole (RFC 7386; custom resources take no strategic
merge patch), so each writer has to send all of ``status.conditions``, and one that
sends it from a stale read puts back the other writer's old condition.

Kubernetes controllers avoid that with the object's ``metadata.resourceVersion``: a write
that carries it is refused with 409 Conflict when the object changed since that version
was read. The writer then reads the object again, recomputes its patch from what is there
now and retries (client-go's ``retry.RetryOnConflict``). :func:`patch_status` does that:
whatever the other writer wrote in between is in the status the patch is computed from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .kube import ApiError, Kube

log = logging.getLogger(__name__)

StatusPatch = Callable[[Mapping[str, Any]], dict[str, Any] | None]
"""The live status -> the status merge patch (``{"status": {...}}``), or None when
nothing needs writing."""

CONFLICT_ATTEMPTS = 5
"""Writes tried before a run of 409 Conflicts is given up (client-go's DefaultRetry
also makes 5): the caller's next run tries again."""


def patch_status(
    kube: Kube,
    kind: str,
    namespace: str,
    name: str,
    compute: StatusPatch,
    attempts: int = CONFLICT_ATTEMPTS,
) -> bool:
    """Read the object, ``compute`` its status patch from the live status and send it
    with the ``metadata.resourceVersion`` that was read, so that the API server refuses it
    (409 Conflict) if anyone wrote the object since; on a conflict read and compute
    again, up to ``attempts`` writes in all.

    Returns True when a patch was written; False when ``compute`` found nothing to write
    or the object is gone (a deleted object has no status to keep). Raises
    :class:`ApiError`: any refusal other than 409 and 404, or the last 409 when every
    attempt conflicted."""
    attempt = 0
    while True:
        attempt += 1
        live = kube.get(kind, namespace, name)
        if live is None:
            return False
        patch = compute(dict(live.get("status") or {}))
        if patch is None:
            return False
        version = live.get("metadata", {}).get("resourceVersion")
        body = {**patch, "metadata": {"resourceVersion": version}} if version else patch
        try:
            kube.patch(kind, namespace, name, body, sub="status")
        except ApiError as e:
            if e.status == 404:
                return False  # deleted since it was read
            if e.status != 409 or attempt >= attempts:
                raise
            log.debug("%s %s/%s changed while its status was written; again", kind, namespace, name)
            continue
        return True
