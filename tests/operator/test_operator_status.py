"""Status folding: conditions from observed children, stable when nothing changed."""

from __future__ import annotations

from typing import Any

from flowprefill_operator.models import ServingPoolStatus
from flowprefill_operator.status import Observed, Problem, fold_status


def dep(
    replicas: int,
    ready: int,
    updated: int,
    *,
    gen: int = 1,
    observed: int = 1,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"generation": gen},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "observedGeneration": observed,
            "conditions": conditions or [],
        },
    }


def fold(
    observed: Observed, previous: ServingPoolStatus | None = None, now: str = "T1"
) -> ServingPoolStatus:
    return fold_status(observed, previous or ServingPoolStatus(), now, selector="s", gateway="g")


def cond(status: ServingPoolStatus, type_: str) -> tuple[str, str]:
    c = next(c for c in status.conditions if c.type == type_)
    return c.status, c.reason


def test_ready_when_all_pods_ready_and_updated() -> None:
    s = fold(Observed(3, 2, dep(2, 2, 2)))
    assert s.phase == "Ready"
    assert cond(s, "Ready") == ("True", "PodsReady")
    assert cond(s, "Progressing") == ("False", "Stable")
    assert cond(s, "Degraded") == ("False", "AsExpected")
    assert (s.observed_generation, s.replicas, s.ready_replicas, s.selector) == (3, 2, 2, "s")


def test_scaling_up_is_progressing() -> None:
    s = fold(Observed(4, 4, dep(2, 2, 2, gen=2, observed=1)))
    assert s.phase == "Progressing"
    assert cond(s, "Ready") == ("False", "PodsNotReady")
    assert cond(s, "Progressing") == ("True", "RollingOut")


def test_unschedulable_pods_mean_insufficient_capacity() -> None:
    pod = {
        "metadata": {"name": "p1"},
        "status": {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                }
            ]
        },
    }
    s = fold(Observed(1, 2, dep(2, 1, 2), pods=[pod]))
    assert s.phase == "Degraded"
    assert cond(s, "Degraded") == ("True", "InsufficientCapacity")
    assert (
        "Insufficient nvidia.com/gpu"
        in next(c for c in s.conditions if c.type == "Degraded").message
    )


def test_crashloop_and_deadline() -> None:
    pod = {
        "metadata": {"name": "p"},
        "status": {
            "containerStatuses": [
                {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}}}
            ]
        },
    }
    assert cond(fold(Observed(1, 1, dep(1, 0, 1), pods=[pod])), "Degraded") == (
        "True",
        "PodsCrashLooping",
    )
    stuck = dep(
        1,
        0,
        1,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "slow",
            }
        ],
    )
    assert cond(fold(Observed(1, 1, stuck)), "Degraded") == ("True", "PodsNotReady")


def test_invalid_spec_phase() -> None:
    s = fold(
        Observed(2, 0, None, problems=[Problem("InvalidSpec", "spec.role: bad", invalid_spec=True)])
    )
    assert s.phase == "Invalid"
    assert cond(s, "Degraded") == ("True", "InvalidSpec")
    assert cond(s, "Progressing")[0] == "False"


def test_same_observation_twice_gives_identical_status() -> None:
    first = fold(Observed(1, 2, dep(2, 1, 2)), now="T1")
    second = fold(Observed(1, 2, dep(2, 1, 2)), previous=first, now="T2")
    assert second == first  # transition times kept: nothing to write
    ready = fold(Observed(1, 2, dep(2, 2, 2)), previous=first, now="T3")
    times = {c.type: c.last_transition_time for c in ready.conditions}
    assert times == {"Ready": "T3", "Progressing": "T3", "Degraded": "T1", "UpdatePending": "T1"}


def test_a_waiting_operator_update_is_a_condition_not_a_problem() -> None:
    waiting = fold(Observed(1, 2, dep(2, 2, 2), update_pending="waits for ns/p1"), now="T1")
    assert cond(waiting, "UpdatePending") == ("True", "OperatorUpdateWaiting")
    assert cond(waiting, "Ready") == ("True", "PodsReady")  # the old pods serve
    assert cond(waiting, "Degraded")[0] == "False" and waiting.phase == "Ready"
    assert cond(fold(Observed(1, 2, dep(2, 2, 2))), "UpdatePending") == ("False", "UpToDate")
