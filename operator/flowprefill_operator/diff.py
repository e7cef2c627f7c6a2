"""Pure: how far a live object is from the desired manifest, as a JSON merge patch.

The operator owns the fields it writes and nothing else: fields the API server or other
controllers add (defaults, status, annotations of others) are left alone. Fields the
operator wrote before and no longer wants are removed using the last applied manifest,
kept in an annotation (the same three-way idea as ``kubectl apply``).
"""

from __future__ import annotations

import json
from typing import Any

LAST_APPLIED = "flowprefill.io/last-applied"
_MISSING = object()


def covers(desired: Any, live: Any) -> bool:
    """Whether ``live`` already holds everything ``desired`` says (extra live fields are fine)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            covers(value, live.get(key, _MISSING)) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(covers(d, lv) for d, lv in zip(desired, live, strict=True))
        )
    return bool(desired == live)


def plan_patch(
    desired: dict[str, Any], live: dict[str, Any], last: dict[str, Any]
) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) that brings ``live`` to ``desired``; ``{}`` if in sync.

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
            sub = plan_patch(value, live_value, last_value if isinstance(last_value, dict) else {})
            if sub:
                patch[key] = sub
        elif not covers(value, live_value):
            patch[key] = value
    return patch


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
