"""Pod-template changes the user did not ask for roll a few pools at a time.

An operator upgrade (a new preStop, a new flag) or a new ``children.*Image`` changes the
pod template the operator renders for every pool at once; applied as they come, every
pool in the cluster would start rolling in the same 30 s, each losing a pod (GPU pools
roll in place) and each loading its model again. So a template change is classified
before it is applied:

- **the user's**: the pool's spec (replicas aside, which the autoscaler and ``kubectl
  scale`` move) differs from the one that rendered the live template — applied at once;
- **the operator's**: the spec is the same — applied only while fewer than
  ``max_pools_updating`` (the chart's ``operator.maxPoolsUpdating``; 0 = no limit) pools
  served by this operator are still rolling an operator's change. A held pool keeps its
  live template (everything else of the Deployment is applied), and its status says so:
  condition ``UpdatePending``. Any edit of the pool's spec releases its change at once:
  the user's signal.

A rolling operator's change that never completes (pods that do not start) keeps its
slot, so the wave stops at the first pool it breaks, as a canary would; that pool's
Degraded condition says why.

The Deployment's annotations carry what is needed across restarts and processes:
:data:`SPEC_DIGEST` (the spec that rendered the live template) and :data:`CAUSE` (who
asked for the live template: ``spec`` or ``operator``). A Deployment from an operator
without them is taken as rendered from today's spec: its template change is the
operator's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from .. import GROUP
from ..builders.common import pool_selector
from ..diff import last_applied, plan_patch
from ..kube import Kube

Manifest = dict[str, Any]
Cause = Literal["spec", "operator"]

SPEC_DIGEST = f"{GROUP}/spec-digest"
"""Digest of the pool spec (without replicas) that rendered the live pod template."""
CAUSE = f"{GROUP}/template-cause"
"""``spec`` or ``operator``: whose change the live pod template is."""
POOL_LABEL = next(iter(pool_selector("x")))
"""The label every pool Deployment carries (its value is the pool's name)."""


def spec_digest(raw_spec: dict[str, Any]) -> str:
    """The pool's spec without ``replicas``, hashed (key order does not matter)."""
    rest = {k: v for k, v in raw_spec.items() if k != "replicas"}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def template_differs(desired: Manifest, live: Manifest) -> bool:
    """Whether applying ``desired`` would write the live Deployment's pod template
    (compared as the apply compares: semantically, see :mod:`..diff`)."""
    patch = plan_patch(desired, live, last_applied(live))
    return "template" in (patch.get("spec") or {})


def rolling(deployment: Manifest) -> bool:
    """Whether a Deployment's rollout is unfinished: its controller has not seen the last
    change, or not every replica runs the current template and is available."""
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    meta = deployment.get("metadata") or {}
    want = int(spec.get("replicas", 1) if spec.get("replicas") is not None else 1)
    return (
        int(status.get("observedGeneration", 0) or 0) < int(meta.get("generation", 0) or 0)
        or int(status.get("updatedReplicas", 0) or 0) < want
        or int(status.get("availableReplicas", 0) or 0) < want
        or int(status.get("replicas", 0) or 0) > want
    )


def rolling_operator_changes(kube: Kube, namespaces: Iterable[str], skip: str) -> list[str]:
    """``namespace/name`` of the pool Deployments still rolling an operator's change, in
    ``namespaces``; the one named ``skip`` (``namespace/name``: the pool deciding) aside."""
    found = []
    for namespace in sorted(set(namespaces)):
        for dep in kube.list("Deployment", namespace):
            meta = dep.get("metadata") or {}
            key = f"{namespace}/{meta.get('name')}"
            labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
            if (
                POOL_LABEL in labels
                and notes.get(CAUSE) == "operator"
                and key != skip
                and rolling(dep)
            ):
                found.append(key)
    return found


@dataclass(frozen=True)
class Gate:
    """The Deployment to apply, and why its template change waits (None: it does not)."""

    deployment: Manifest
    pending: str | None = None


def _annotated(deployment: Manifest, digest: str, cause: str) -> Manifest:
    meta = deployment["metadata"]
    notes = {**(meta.get("annotations") or {}), SPEC_DIGEST: digest, CAUSE: cause}
    return {**deployment, "metadata": {**meta, "annotations": notes}}


def _held(desired: Manifest, live: Manifest) -> Manifest:
    """``desired`` with the template the operator applied before (its last-applied record,
    so that server defaults are not written back; the live one if there is none)."""
    before = (last_applied(live).get("spec") or {}).get("template")
    template = before if before is not None else (live.get("spec") or {}).get("template")
    return {**desired, "spec": {**desired["spec"], "template": template}}


def gate_deployment(
    kube: Kube,
    desired: Manifest,
    raw_spec: dict[str, Any],
    namespaces: Iterable[str],
    max_updating: int,
) -> Gate:
    """Decide whether ``desired`` (a pool's Deployment) may change its live pod template
    now, per the module's rules; the result carries the annotations either way.

    ``namespaces``: those of every pool this operator serves (the wave is counted across
    them); ``max_updating``: pools that may roll an operator's change at once (0: any).
    The caller holds the gate's lock, so two pools never take the last slot together."""
    meta = desired["metadata"]
    digest = spec_digest(raw_spec)
    live = kube.get("Deployment", meta["namespace"], meta["name"])
    if live is None:
        return Gate(_annotated(desired, digest, "spec"))
    notes = live.get("metadata", {}).get("annotations") or {}
    if not template_differs(desired, live):
        # Same template: its cause stays what it was until the next change.
        return Gate(_annotated(desired, digest, notes.get(CAUSE, "spec")))
    if notes.get(SPEC_DIGEST, digest) != digest:
        return Gate(_annotated(desired, digest, "spec"))
    if max_updating <= 0:
        return Gate(_annotated(desired, digest, "operator"))
    key = f"{meta['namespace']}/{meta['name']}"
    busy = rolling_operator_changes(kube, namespaces, skip=key)
    if len(busy) < max_updating:
        return Gate(_annotated(desired, digest, "operator"))
    held = _annotated(_held(desired, live), digest, notes.get(CAUSE, "spec"))
    shown = ", ".join(busy[:3]) + (f" and {len(busy) - 3} more" if len(busy) > 3 else "")
    message = (
        "a new pod template from the operator (an upgrade or new default images) waits "
        f"while {len(busy)} pool(s) roll theirs ({shown}; at most {max_updating} at a time, "
        "the chart's operator.maxPoolsUpdating); any edit of this pool's spec applies it now"
    )
    return Gate(held, message)
