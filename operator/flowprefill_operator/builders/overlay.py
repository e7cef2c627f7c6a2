"""The user's pod overlay (``spec.pod`` / ``spec.gatewayPod``) merged onto a rendered pod.

The builders render each Deployment's pod template first (their own volumes, env,
security contexts, ``resources.nodeSelector``/``tolerations``), then pass it through
:func:`apply_pod_overlay`. The merge rules are the contract ``docs/pods.md`` documents.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

from ..models.podoverlay import PodOverlay

Template = dict[str, Any]

_SCALARS = (
    "serviceAccountName",
    "automountServiceAccountToken",
    "priorityClassName",
    "runtimeClassName",
    "schedulerName",
)
"""Pod spec fields the overlay sets outright when given (its value replaces the operator's)."""


class OverlayConflict(ValueError):
    """The overlay names a volume or mount path the operator's pod already has (a pod with
    both would be refused by the API server; this says which field to change instead)."""


def _dedup(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))  # first occurrence wins, order kept


def _merge_env(own: list[dict[str, Any]], extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``own`` with each same-named entry replaced in place by ``extra``'s, then the rest of
    ``extra`` in order: one entry per name (no duplicate-name warnings), the user's value
    wins, and the operator's later ``$(VAR)`` references still see the name before them."""
    by_name = {e["name"]: e for e in extra}
    merged = [copy.deepcopy(by_name.pop(e["name"], e)) for e in own]
    return merged + [copy.deepcopy(e) for e in extra if e["name"] in by_name]


def _merge_container_security(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = {**base, **{k: v for k, v in over.items() if k != "capabilities"}}
    if "capabilities" in over:
        # add and drop separately: adding one capability keeps the default drop ALL; the
        # overlay's add joins the template's (IPC_LOCK of a nixl pool) instead of replacing it.
        own = base.get("capabilities", {})
        merged["capabilities"] = {**own, **over["capabilities"]}
        if own.get("add") and "add" in over["capabilities"]:
            merged["capabilities"]["add"] = _dedup([*own["add"], *over["capabilities"]["add"]])
    return merged


def apply_pod_overlay(
    template: Template, overlay: PodOverlay | None, *, pull_secrets: Sequence[str] = ()
) -> Template:
    """A new pod template: ``template`` (a Deployment's ``spec.template``, as the builders
    render it) with the operator-wide ``pull_secrets`` and the user's ``overlay`` merged in.

    Pure: ``template`` and ``overlay`` are left untouched. The rules, field by field:

    - ``labels``/``annotations``: added to ``metadata``; the template's win on a key both
      set (the CRD keeps the operator's prefixes out of the overlay, so none collide).
    - ``imagePullSecrets``: any the template already has, then ``pull_secrets`` (the
      operator-wide ones), then the overlay's; one entry per name, the first kept.
    - ``serviceAccountName``, ``automountServiceAccountToken``, ``priorityClassName``,
      ``runtimeClassName``, ``schedulerName``: set when the overlay gives them.
    - ``nodeSelector``: merged; the overlay wins per key. ``tolerations`` and
      ``topologySpreadConstraints``: appended. ``affinity``: merged per kind
      (nodeAffinity, podAffinity, podAntiAffinity); the overlay's replaces a kind whole.
    - ``securityContext``: merged key by key over the pod's (a nested key such as
      ``seccompProfile`` is replaced whole).
    - ``containerSecurityContext``: merged key by key over every container's and init
      container's ``securityContext``; ``capabilities.add``/``drop`` merge separately, the
      overlay's ``drop`` replacing the operator's, its ``add`` appended to the operator's
      (a nixl pool's ``IPC_LOCK`` stays; ``kvHandoff.nixl.ipcLock: false`` removes it).
    - ``env``: into every container and init container; an entry named as one of the
      container's replaces it in place, the others are appended in order.
    - ``envFrom``: appended to every container and init container (explicit ``env`` wins
      over ``envFrom`` in Kubernetes, so the operator's variables still hold).
    - ``volumes``: appended to the pod; ``volumeMounts``: appended to every main container
      (init containers get none).

    Raises :class:`OverlayConflict` when an overlay volume's name is already a volume of
    the template, or an overlay mount's path is already a mount path of a main container.
    """
    out = copy.deepcopy(template)
    meta: dict[str, Any] = out.setdefault("metadata", {})
    spec: dict[str, Any] = out.setdefault("spec", {})
    ov = overlay or PodOverlay()
    wire = ov.wire()

    for key in ("labels", "annotations"):
        if wire.get(key):
            meta[key] = {**wire[key], **meta.get(key, {})}

    secrets = _dedup(
        [
            *(s["name"] for s in spec.get("imagePullSecrets", [])),
            *pull_secrets,
            *(s.name for s in ov.image_pull_secrets),
        ]
    )
    if secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in secrets]

    for key in _SCALARS:
        if key in wire:
            spec[key] = wire[key]

    if ov.node_selector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **ov.node_selector}
    for key in ("tolerations", "topologySpreadConstraints"):
        if wire.get(key):
            spec[key] = [*spec.get(key, []), *wire[key]]
    if wire.get("affinity"):
        spec["affinity"] = {**spec.get("affinity", {}), **wire["affinity"]}

    if "securityContext" in wire:
        spec["securityContext"] = {**spec.get("securityContext", {}), **wire["securityContext"]}

    containers: list[dict[str, Any]] = spec.get("containers", [])
    every = [*containers, *spec.get("initContainers", [])]
    for c in every:
        if "containerSecurityContext" in wire:
            c["securityContext"] = _merge_container_security(
                c.get("securityContext", {}), wire["containerSecurityContext"]
            )
        if wire.get("env"):
            c["env"] = _merge_env(c.get("env", []), wire["env"])
        if wire.get("envFrom"):
            c["envFrom"] = [*c.get("envFrom", []), *copy.deepcopy(wire["envFrom"])]

    if wire.get("volumes"):
        taken = {v["name"] for v in spec.get("volumes", [])}
        if clash := sorted(taken & {v["name"] for v in wire["volumes"]}):
            raise OverlayConflict(f"pod.volumes: {clash} already name the operator's volumes")
        spec["volumes"] = [*spec.get("volumes", []), *wire["volumes"]]
    if wire.get("volumeMounts"):
        paths = {m["mountPath"] for m in wire["volumeMounts"]}
        for c in containers:
            if clash := sorted(paths & {m["mountPath"] for m in c.get("volumeMounts", [])}):
                raise OverlayConflict(
                    f"pod.volumeMounts: container {c.get('name')!r} already mounts {clash}"
                )
            c["volumeMounts"] = [*c.get("volumeMounts", []), *copy.deepcopy(wire["volumeMounts"])]
    return out
