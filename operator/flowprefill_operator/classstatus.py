"""Pure: an SLOClass's status conditions, and when its observed attainment is written.

Conditions (Kubernetes style; ``lastTransitionTime`` kept while the status holds):

- ``Ready``: True (``Accepted``) when the class is in use as specified; False with the
  verdict's reason (``DuplicateDefault``, ``SecretNotFound``, ``InvalidSpec`` ...) when not.
- ``Degraded``: True, reason ``AttainmentBelowTarget``, when the window's attainment is
  below ``spec.attainmentTarget`` over at least :data:`MIN_REQUESTS` requests; False with
  ``AttainmentMet``, or ``NoTraffic`` when the window holds fewer requests than that (a
  handful of requests says nothing either way).

Two controllers write them (Ready the class sync, Degraded the attainment job), each
sending the whole list a merge patch replaces; the patches here are computed from the
live status and sent with its resourceVersion (:mod:`.statuspatch`), so neither puts
back an old copy of the other's condition.

Write rate. Attainment, ``requestCount`` and ``shedCount`` change with every request, and
the scraper folds them every ``attainmentIntervalSeconds`` (30 s); writing each change
would rewrite every class in etcd twice a minute for numbers Prometheus already has. So
the status is written only when:

1. it was never written (no ``attainmentTime``), or a condition changes status or reason;
2. the attainment moved by at least :data:`ATTAINMENT_STEP` (one percentage point), or
   appeared or vanished;
3. anything else differs (request or shed counts) and the last write is at least
   :data:`REFRESH_S` (5 minutes) old.

``attainmentTime`` says when the numbers were taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from .models import Condition, SLOClassStatus

MIN_REQUESTS = 20
"""Fewer requests in the window: Degraded is False with reason NoTraffic."""
ATTAINMENT_STEP = 0.01
"""An attainment change this large (absolute) is written at once."""
REFRESH_S = 300.0
"""Smaller changes (and request/shed counts) are written at most this often."""
RFC3339 = "%Y-%m-%dT%H:%M:%SZ"


def set_condition(conditions: list[Condition], new: Condition, now: str) -> list[Condition]:
    """``conditions`` with ``new`` in place of its type (order kept, new types last); the
    transition time moves only when the status changes."""
    before = next((c for c in conditions if c.type == new.type), None)
    since = before.last_transition_time if before and before.status == new.status else now
    new = new.model_copy(update={"last_transition_time": since})
    out = [new if c.type == new.type else c for c in conditions]
    return out if before else [*out, new]


def ready_condition(accepted: bool, reason: str, message: str, generation: int | None) -> Condition:
    """Ready from the class's verdict."""
    return Condition(
        type="Ready",
        status="True" if accepted else "False",
        reason="Accepted" if accepted else reason,
        message=message,
        observed_generation=generation,
    )


def degraded_condition(
    attainment: float | None,
    requests: int,
    target: float | None,
    window_s: int,
    generation: int | None,
) -> Condition:
    """Degraded from the window's attainment against the class's target (None: the spec
    is invalid, nothing to judge against)."""
    if attainment is None or target is None or requests < MIN_REQUESTS:
        return Condition(
            type="Degraded",
            status="False",
            reason="NoTraffic",
            message=f"{requests} requests in the last {window_s} s (fewer than {MIN_REQUESTS})",
            observed_generation=generation,
        )
    below = attainment < target
    return Condition(
        type="Degraded",
        status="True" if below else "False",
        reason="AttainmentBelowTarget" if below else "AttainmentMet",
        message=f"attainment {attainment:.4f} {'<' if below else '>='} target {target} "
        f"over {requests} requests in the last {window_s} s",
        observed_generation=generation,
    )


def _changed(before: list[Condition], after: list[Condition]) -> bool:
    key = lambda cs: {c.type: (c.status, c.reason) for c in cs}  # noqa: E731
    return key(before) != key(after)


def attainment_patch(
    status: Mapping[str, Any],
    fields: Mapping[str, Any],
    target: float | None,
    generation: int | None,
    now: datetime,
) -> dict[str, Any] | None:
    """The status merge patch for a class's new window ``fields`` (``attainment``,
    ``requestCount``, ``shedCount``, ``windowSeconds``) with its Degraded condition, or
    None when the write-rate rule above says not yet."""
    previous: SLOClassStatus = SLOClassStatus.model_validate(
        {k: v for k, v in status.items() if k in _KNOWN}
    )
    stamp = now.strftime(RFC3339)
    degraded = degraded_condition(
        fields.get("attainment"),
        int(fields.get("requestCount") or 0),
        target,
        int(fields.get("windowSeconds") or 0),
        generation,
    )
    conditions = set_condition(previous.conditions, degraded, stamp)
    old, new = previous.attainment, fields.get("attainment")
    due = (
        previous.attainment_time is None
        or _changed(previous.conditions, conditions)
        or (old is None) != (new is None)
        or (old is not None and new is not None and abs(new - old) >= ATTAINMENT_STEP)
    )
    if not due:
        differs = any(status.get(k) != v for k, v in fields.items())
        last = datetime.strptime(previous.attainment_time or stamp, RFC3339)
        age = (now.replace(tzinfo=None) - last).total_seconds()
        due = differs and age >= REFRESH_S
    if not due:
        return None
    wire = [c.model_dump(by_alias=True, exclude_none=True) for c in conditions]
    return {"status": {**fields, "attainmentTime": stamp, "conditions": wire}}


_KNOWN = {f.alias or n for n, f in SLOClassStatus.model_fields.items()}
