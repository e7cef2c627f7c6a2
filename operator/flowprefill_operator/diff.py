"""Pure: how far a live object is from the desired manifest, as a JSON merge patch.

The operator owns the fields it writes and nothing else: fields the API server or other
controllers add (defaults, status, annotations of others) are left alone. Fields the
operator wrote before and no longer wants are removed using the last applied manifest,
kept in an annotation (the same three-way idea as ``kubectl apply``).

"Already holds" is semantic, as the API server stores things, not textual:

- quantities (``resources.requests``/``limits`` values, ``sizeLimit`` ...) are compared
  by value: the server stores ``1.5Gi`` as ``1536Mi`` and ``1000m`` as ``1``
  (apimachinery's ``Quantity`` canonical form), and the two mean the same;
- an empty list or map the operator writes is held by an absent field: Go's
  ``omitempty`` drops empty slices and maps when the server stores the object;
- fields the server defaults (``strategy``, ``imagePullPolicy``, a Service's
  ``sessionAffinity`` ...) are extra live fields, which never count as drift.

So an object the server normalised plans no patch, and an operator restart writes nothing.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

LAST_APPLIED = "flowprefill.io/last-applied"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
_MISSING = object()

QUANTITY_MAPS = frozenset({"requests", "limits", "hard", "capacity", "overhead"})
"""Maps whose values are all quantities (ResourceRequirements, ResourceQuota, PVC ...)."""
QUANTITY_FIELDS = frozenset({"sizeLimit"})
"""Single fields holding a quantity (``emptyDir.sizeLimit``)."""


def quantity(value: Any) -> Decimal | None:
    """The value of a Kubernetes quantity (``"1.5Gi"``, ``"500m"``, ``2``), or None when
    ``value`` is not one (parsed by the official client's ``parse_quantity``)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    try:
        parsed: Decimal = parse_quantity(value)
    except ValueError:
        return None
    return parsed


def same_value(desired: Any, live: Any, *, is_quantity: bool) -> bool:
    """Leaf equality; quantities by value when the field holds one."""
    if desired == live:
        return True
    if is_quantity:
        a, b = quantity(desired), quantity(live)
        return a is not None and a == b
    return False


def covers(
    desired: Any, live: Any, *, is_quantity: bool = False, quantity_map: bool = False
) -> bool:
    """Whether ``live`` already holds everything ``desired`` says (extra live fields are
    fine; quantities compare by value; an empty list or map is held by an absent field).
    ``is_quantity``: the value is a quantity; ``quantity_map``: its values are."""
    if live is _MISSING and isinstance(desired, dict | list) and not desired:
        return True
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            covers(
                value,
                live.get(key, _MISSING),
                is_quantity=quantity_map or key in QUANTITY_FIELDS,
                quantity_map=key in QUANTITY_MAPS,
            )
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(covers(d, lv) for d, lv in zip(desired, live, strict=True))
        )
    return same_value(desired, live, is_quantity=is_quantity)


def plan_patch(
    desired: dict[str, Any],
    live: dict[str, Any],
    last: dict[str, Any],
    *,
    quantity_map: bool = False,
) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) that brings ``live`` to ``desired``; ``{}`` if in sync
    (in the sense of :func:`covers`; ``quantity_map``: the values are quantities).

    Lists are replaced whole (merge-patch semantics), so list fields are written entirely.
    """
    patch: dict[str, Any] = {}
    for key in last.keys() - desired.keys():
        if key in live:
            patch[key] = None
    for key, value in desired.items():
        live_value = live.get(key, _MISSING)
        last_value = last.get(key)
        if isinstance(value, dict) and isinstance(live_value, dict):
            sub = plan_patch(
                value,
                live_value,
                last_value if isinstance(last_value, dict) else {},
                quantity_map=key in QUANTITY_MAPS,
            )
            if sub:
                patch[key] = sub
        elif not covers(
            value,
            live_value,
            is_quantity=quantity_map or key in QUANTITY_FIELDS,
            quantity_map=key in QUANTITY_MAPS,
        ):
            patch[key] = value
    return patch


def owned(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether the operator may write ``live``: it carries the managed-by label the desired
    manifest carries, or an ownerReference (by uid) the desired manifest names. A
    same-named object made by someone else is neither, and is never adopted."""
    live_meta, want_meta = live.get("metadata") or {}, desired.get("metadata") or {}
    label = (want_meta.get("labels") or {}).get(MANAGED_BY_LABEL)
    if label and (live_meta.get("labels") or {}).get(MANAGED_BY_LABEL) == label:
        return True
    wanted_uids = {r.get("uid") for r in want_meta.get("ownerReferences") or []}
    return any(r.get("uid") in wanted_uids for r in live_meta.get("ownerReferences") or [])


def with_last_applied(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its own JSON recorded in the last-applied annotation."""
    meta = dict(manifest.get("metadata", {}))
    annotations = dict(meta.get("annotations", {}))
    annotations.pop(LAST_APPLIED, None)
    bare = {**manifest, "metadata": {**meta, "annotations": annotations}}
    if not annotations:
        del bare["metadata"]["annotations"]
    annotations[LAST_APPLIED] = json.dumps(bare, sort_keys=True, separators=(",", ":"))
    return {**manifest, "metadata": {**meta, "annotations": annotations}}


def last_applied(live: dict[str, Any]) -> dict[str, Any]:
    raw = live.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
