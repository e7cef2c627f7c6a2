"""Pure: observed children of a pool -> its status (conditions, replicas, phase).

A child the API server refused (or a same-named object that is not ours) is a Degraded
problem marked ``not_applied``: Ready is then False with that reason and message, and
``observedGeneration`` keeps the last generation that was applied in full.

Conditions keep their ``lastTransitionTime`` while their status does not change, so a
status computed twice from the same observations is identical (no write, no event).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .builders.model import DOWNLOAD_CONTAINERS
from .models import Condition, ServingPoolStatus

WAITING_FAILURES = {
    "CrashLoopBackOff": "PodsCrashLooping",
    "ImagePullBackOff": "ImagePullFailed",
    "ErrImagePull": "ImagePullFailed",
    "CreateContainerConfigError": "PodConfigError",
}


@dataclass(frozen=True)
class Problem:
    """Something wrong with the spec or its references: Degraded with this reason."""

    reason: str
    message: str
    invalid_spec: bool = False
    blocks_pods: bool = False
    """The pool's pods could not start (e.g. the model's download would fail): the
    operator leaves its Deployment as it is rather than roll pods into a crash loop."""
    not_applied: bool = False
    """A child of this generation could not be written (the API server refused it, or a
    same-named object is not ours): the status must not claim the generation applied."""


@dataclass(frozen=True)
class Observed:
    """What the operator saw of one pool's children."""

    generation: int | None
    desired_replicas: int
    deployment: dict[str, Any] | None
    pods: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    update_pending: str | None = None
    """Why a new pod template from the operator waits (controllers.upgrades), if it does."""


def pod_problems(pods: list[dict[str, Any]]) -> list[Problem]:
    """Unschedulable pods (InsufficientCapacity) and failing containers, one per reason."""
    found: dict[str, Problem] = {}
    for pod in pods:
        name = pod.get("metadata", {}).get("name", "?")
        status = pod.get("status", {})
        for cond in status.get("conditions", []):
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                found.setdefault(
                    "InsufficientCapacity",
                    Problem("InsufficientCapacity", f"pod {name}: {cond.get('message', '')}"),
                )
        for cs in status.get("initContainerStatuses", []):
            if (problem := download_problem(name, cs)) is not None:
                found.setdefault(problem.reason, problem)
        for cs in status.get("containerStatuses", []):
            waiting = cs.get("state", {}).get("waiting", {})
            reason = WAITING_FAILURES.get(waiting.get("reason", ""))
            if reason:
                found.setdefault(
                    reason, Problem(reason, f"pod {name}: {waiting.get('message', '')}".strip())
                )
    return list(found.values())


def download_problem(pod: str, status: dict[str, Any]) -> Problem | None:
    """A failed model download step, from its termination message (``<Reason>: <message>``
    as ``flowprefill fetch-model`` writes it; the log's tail where it died before): the
    last run's while the kubelet backs off restarting it."""
    if status.get("name") not in DOWNLOAD_CONTAINERS:
        return None
    state = status.get("state", {})
    terminated = state.get("terminated") or status.get("lastState", {}).get("terminated")
    if not terminated or terminated.get("exitCode", 0) == 0:
        return None
    text = (terminated.get("message") or "").strip()
    head, sep, rest = text.partition(": ")
    if sep and head.isalnum() and head[:1].isupper():
        reason, message = head, rest
    else:
        reason = "ModelDownloadFailed"
        message = text.splitlines()[-1] if text else f"exit code {terminated.get('exitCode')}"
    return Problem(reason, f"pod {pod}: {status['name']}: {message}")


def _deployment_problem(dep: dict[str, Any]) -> Problem | None:
    for cond in dep.get("status", {}).get("conditions", []):
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Problem("PodsNotReady", cond.get("message", "progress deadline exceeded"))
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return Problem("ReplicaFailure", cond.get("message", ""))
    return None


def _condition(
    type_: str,
    ok: bool,
    reason: str,
    message: str,
    previous: list[Condition],
    now: str,
    gen: int | None,
) -> Condition:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.type == type_), None)
    since = before.last_transition_time if before and before.status == status else now
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=gen,
    )


def fold_status(
    observed: Observed,
    previous: ServingPoolStatus,
    now: str,
    *,
    selector: str,
    gateway: str,
) -> ServingPoolStatus:
    """The pool's status from what was observed (``now``: RFC 3339, for new transitions)."""
    dep = observed.deployment or {}
    dep_status = dep.get("status", {})
    replicas = int(dep_status.get("replicas", 0) or 0)
    ready = int(dep_status.get("readyReplicas", 0) or 0)
    updated = int(dep_status.get("updatedReplicas", 0) or 0)
    desired = observed.desired_replicas
    dep_current = bool(dep) and (
        dep_status.get("observedGeneration", 0) >= dep.get("metadata", {}).get("generation", 0)
    )

    problems = list(observed.problems)
    if dep:
        problems += pod_problems(observed.pods)
        if (problem := _deployment_problem(dep)) is not None:
            problems.append(problem)

    settled = dep_current and ready == desired and updated == desired and replicas == desired
    if observed.deployment is None:
        ready_reason, ready_msg = "NotCreated", "the Deployment does not exist yet"
    elif settled:
        ready_reason = "ScaledToZero" if desired == 0 else "PodsReady"
        ready_msg = f"{ready}/{desired} pods ready"
    else:
        ready_reason, ready_msg = "PodsNotReady", f"{ready}/{desired} pods ready"

    refused = next((p for p in problems if p.not_applied), None)
    if refused is not None:
        # What runs may be an older generation's template: never Ready on a failed apply.
        ready_reason, ready_msg = refused.reason, refused.message
    degraded = problems[0] if problems else None
    gen, prev = observed.generation, previous.conditions
    conditions = [
        _condition("Ready", settled and not degraded, ready_reason, ready_msg, prev, now, gen),
        _condition(
            "Progressing",
            not settled and not (degraded and degraded.invalid_spec),
            "RollingOut" if not settled else "Stable",
            f"{updated}/{desired} updated, {ready}/{desired} ready",
            prev,
            now,
            gen,
        ),
        _condition(
            "Degraded",
            degraded is not None,
            degraded.reason if degraded else "AsExpected",
            "; ".join(p.message for p in problems) if problems else "",
            prev,
            now,
            gen,
        ),
        _condition(
            "UpdatePending",
            observed.update_pending is not None,
            "OperatorUpdateWaiting" if observed.update_pending else "UpToDate",
            observed.update_pending or "",
            prev,
            now,
            gen,
        ),
    ]
    if degraded and degraded.invalid_spec:
        phase = "Invalid"
    elif degraded:
        phase = "Degraded"
    elif observed.deployment is None:
        phase = "Pending"
    elif settled:
        phase = "Ready"
    else:
        phase = "Progressing"
    return ServingPoolStatus(
        # Only a generation whose children were all written counts as observed.
        observed_generation=gen if refused is None else previous.observed_generation,
        replicas=replicas,
        ready_replicas=ready,
        updated_replicas=updated,
        selector=selector,
        phase=phase,
        gateway=gateway,
        conditions=conditions,
    )
