"""Pure: how pods are replaced and how they go away — the Deployment's update strategy,
its progress deadline, and each role's preStop drain and grace period.

Draining, per role (the process's own shutdown is what bounds the drain; the operator
only sizes the pod's budget around it):

1. ``preStop`` sleeps :data:`PRESTOP_SLEEP_S`: the terminating pod is already out of its
   EndpointSlices (``ready: false``), and this is the time for kube-proxy, the cluster DNS
   cache and the gateway's next lookup of the pool's headless name to stop sending new
   requests to it (the process still serves all that time; KServe and llm-d do the same).
2. SIGTERM: the process stops taking requests and finishes the in-flight ones, up to its
   drain bound — vLLM's ``--shutdown-timeout`` (decode; vLLM's default 0 aborts every
   stream at once), the prefill server's ``--drain-timeout`` and then its engine close
   (:data:`PREFILL_ENGINE_CLOSE_S`), the gateway's ``--drain-timeout``
   (:data:`GATEWAY_DRAIN_S`).
3. ``terminationGracePeriodSeconds`` = sleep + drain + :data:`GRACE_MARGIN_S`, so the
   kubelet's SIGKILL never lands before the process's own bound.
"""

from __future__ import annotations

from typing import Any

from flowprefill.contracts.processes import DRAIN_TIMEOUT_FLAG

from ..models import ServingPoolSpec

PRESTOP_SLEEP_S = 15
"""Seconds a terminating pod keeps serving before SIGTERM (endpoints and DNS catch up)."""
DECODE_DRAIN_S = 300
"""Default bound on a decode pod's in-flight streams after SIGTERM: 8K tokens at about
30 tokens/s; ``spec.rollout.drainSeconds`` changes it."""
PREFILL_DRAIN_S = 60
"""Default bound on a prefill pod's in-flight prefills (each bounded by its TTFT SLO,
18 s at most in the paper's tables) and the hand-offs decode still pulls."""
PREFILL_ENGINE_CLOSE_S = 30
"""The prefill server's engine close after its HTTP drain (flowprefill/prefill/server)."""
GATEWAY_DRAIN_S = DECODE_DRAIN_S
"""The gateway's drain bound (``serve-gateway --drain-timeout``): it relays decode's
streams, so it waits as long as a decode pod does."""
GRACE_MARGIN_S = 15
"""Slack between the process's drain bound and the kubelet's SIGKILL."""

DECODE_SHUTDOWN_FLAG = "--shutdown-timeout"
"""vLLM's drain bound (seconds; 0, its default, aborts in-flight requests)."""
PREFILL_DRAIN_FLAG = DRAIN_TIMEOUT_FLAG
"""``flowprefill serve-prefill``'s drain bound (seconds)."""

PROGRESS_MARGIN_S = 600
"""Added to a pod's startup budget in its Deployment's progress deadline: scheduling, the
image pull of a multi-GB image, init containers that copy rather than download."""
DOWNLOAD_ALLOWANCE_S = 3600
"""Added for a pod that downloads its model first (``hf://``): an hour for the weights."""

K8S_DEFAULT_SURGE = "25%"
"""Kubernetes' default maxSurge and maxUnavailable (kept explicit for CPU pools)."""


def strategy(spec: ServingPoolSpec) -> dict[str, Any]:
    """The Deployment's ``strategy``: ``spec.rollout`` where given; else no surge beyond
    the pool's GPUs on a GPU pool (maxSurge 0, maxUnavailable 1: replaced in place, one
    pod at a time), Kubernetes' 25 %/25 % on a CPU pool. A GPU pool that sets only
    ``maxUnavailable: 0`` gets ``maxSurge: 1`` (it asked never to lose a pod)."""
    rollout = spec.rollout
    if rollout is not None and rollout.type == "Recreate":
        return {"type": "Recreate"}
    surge = rollout.max_surge if rollout else None
    unavailable = rollout.max_unavailable if rollout else None
    if spec.on_gpu:
        if surge is None:
            surge = 1 if unavailable == 0 else 0
        if unavailable is None:
            unavailable = 1 if surge == 0 else 0
    rolling: dict[str, int | str] = {
        "maxSurge": K8S_DEFAULT_SURGE if surge is None else surge,
        "maxUnavailable": K8S_DEFAULT_SURGE if unavailable is None else unavailable,
    }
    return {"type": "RollingUpdate", "rollingUpdate": rolling}


def startup_budget_s(container: dict[str, Any]) -> int:
    """Seconds the container's startupProbe allows before the kubelet restarts it:
    initialDelay + failureThreshold × periodSeconds (0 without a startup probe)."""
    probe = container.get("startupProbe")
    if not probe:
        return 0
    return int(probe.get("initialDelaySeconds", 0)) + int(probe.get("failureThreshold", 3)) * int(
        probe.get("periodSeconds", 10)
    )


def progress_deadline_s(pod_spec: dict[str, Any], *, downloads: bool) -> int:
    """``progressDeadlineSeconds`` of a Deployment whose pods are ``pod_spec``: the longest
    startup budget of its containers plus :data:`PROGRESS_MARGIN_S` (and
    :data:`DOWNLOAD_ALLOWANCE_S` when ``downloads``), so a pod that loads within what its
    startupProbe allows is never reported as a stalled rollout (Kubernetes' default, 600 s,
    is shorter than a 70B model's load)."""
    budget = max((startup_budget_s(c) for c in pod_spec.get("containers", [])), default=0)
    return budget + PROGRESS_MARGIN_S + (DOWNLOAD_ALLOWANCE_S if downloads else 0)


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``); None if absent."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def pool_drain_s(spec: ServingPoolSpec, process: str | None = None) -> int:
    """The drain bound of the pool's ``process`` (``prefill`` or ``decode``; None: the
    pool's role): ``rollout.drainSeconds``, else decode's own ``--shutdown-timeout`` in
    vllmArgs, else the role's default. A colocated pod's bound is the longer of its two
    processes' (they drain side by side after one SIGTERM)."""
    role = process or spec.role
    if role == "colocated":
        return max(pool_drain_s(spec, "prefill"), pool_drain_s(spec, "decode"))
    if spec.rollout is not None and spec.rollout.drain_seconds is not None:
        return spec.rollout.drain_seconds
    if role == "decode":
        given = flag_value(list(spec.vllm_args), DECODE_SHUTDOWN_FLAG)
        if given is not None and given.isdigit():
            return int(given)
        return DECODE_DRAIN_S
    return PREFILL_DRAIN_S


def drain_args(spec: ServingPoolSpec, process: str | None = None) -> list[str]:
    """The flag that bounds ``process``'s drain (None: the pool's role, prefill or
    decode; none when vllmArgs already set it)."""
    role = process or spec.role
    if role == "decode":
        if flag_value(list(spec.vllm_args), DECODE_SHUTDOWN_FLAG) is not None:
            return []
        return [DECODE_SHUTDOWN_FLAG, str(pool_drain_s(spec, "decode"))]
    return [PREFILL_DRAIN_FLAG, str(pool_drain_s(spec, "prefill"))]


def termination(drain_s: int) -> tuple[dict[str, Any], int]:
    """The container's ``lifecycle`` (a preStop sleep) and the pod's grace period for a
    process that drains within ``drain_s`` after SIGTERM."""
    lifecycle = {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}}
    return lifecycle, PRESTOP_SLEEP_S + drain_s + GRACE_MARGIN_S


def pool_termination(spec: ServingPoolSpec) -> tuple[dict[str, Any], int]:
    """:func:`termination` of a pool's pods (prefill adds its engine close; a colocated
    pod waits for the slower of its two processes)."""
    if spec.role == "decode":
        return termination(pool_drain_s(spec))
    drain = pool_drain_s(spec, "prefill") + PREFILL_ENGINE_CLOSE_S
    if spec.role == "colocated":  # both drain at once; the pod waits for the slower
        drain = max(drain, pool_drain_s(spec, "decode"))
    return termination(drain)
