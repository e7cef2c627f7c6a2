"""Rollouts that need no spare GPU, progress deadlines from the startup budget, and drains
sized to in-flight work (builders/rollout.py; issue 22 items 1, 2 and 8).

The checks read the rendered Deployments the way the Deployment controller does: an
absent strategy is Kubernetes' 25 % surge (rounded up) / 25 % unavailable (rounded down),
an absent progress deadline is 600 s, an absent grace period 30 s.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import kubernetes_validate
import pytest
from flowprefill_operator.builders import PoolRef, build_gateway_children, build_pool_children
from flowprefill_operator.models import ServingPoolSpec, SLOTable
from flowprefill_operator.models.rollout import BOTH_ZERO, RECREATE_TAKES_NO_SURGE
from flowprefill_operator.settings import OperatorSettings
from pydantic import ValidationError

from tests.operator.crdcheck import validate_cr

SETTINGS = OperatorSettings()
K8S_DEFAULT_PROGRESS_DEADLINE_S = 600
K8S_DEFAULT_GRACE_S = 30


def _spec(role: str = "prefill", **spec: Any) -> dict[str, Any]:
    return {"service": "llama3-70b", "role": role, "model": {"path": "/models/m"}, **spec}


GPU_PREFILL = _spec(replicas=1, resources={"gpusPerPod": 4}, engine={"tpSize": 4})
GPU_DECODE = _spec(
    "decode", replicas=2, resources={"gpusPerPod": 8}, vllm={"tensorParallelSize": 8}
)
HUB_DECODE = _spec(
    "decode", model={"uri": "hf://meta-llama/Llama-3.3-70B-Instruct"}, resources={"gpusPerPod": 4}
)
CPU_DECODE = _spec("decode", replicas=1, resources={"gpusPerPod": 0, "cpu": "4"})
CPU_PREFILL = _spec(resources={"gpusPerPod": 0}, engine={"device": "cpu"})
EVERY_POOL = [GPU_PREFILL, GPU_DECODE, HUB_DECODE, CPU_DECODE, CPU_PREFILL]


def _pool(spec: dict[str, Any], name: str = "p") -> PoolRef:
    return PoolRef(name, "ns", "uid-" + name, ServingPoolSpec.model_validate(spec))


def _deployment(spec: dict[str, Any]) -> dict[str, Any]:
    return next(m for m in build_pool_children(_pool(spec), SETTINGS) if m["kind"] == "Deployment")


def _gateway_deployment(spec: dict[str, Any] = GPU_PREFILL) -> dict[str, Any]:
    children = build_gateway_children(
        [_pool(spec)], SLOTable(default_class=None, classes=[]), SETTINGS
    )
    return next(m for m in children if m["kind"] == "Deployment")


def _resolve(value: int | str, replicas: int, *, up: bool) -> int:
    """An IntOrString as the Deployment controller resolves it against replicas."""
    if isinstance(value, int):
        return value
    share = int(value.rstrip("%")) * replicas / 100
    return math.ceil(share) if up else math.floor(share)


def _surge(dep: dict[str, Any]) -> int:
    """Pods a rolling update may run above replicas (Kubernetes' defaults when absent)."""
    strategy = dep["spec"].get("strategy", {"type": "RollingUpdate"})
    if strategy["type"] == "Recreate":
        return 0
    rolling = strategy.get("rollingUpdate", {})
    return _resolve(rolling.get("maxSurge", "25%"), dep["spec"]["replicas"], up=True)


def _gpus(dep: dict[str, Any]) -> int:
    limits = dep["spec"]["template"]["spec"]["containers"][0].get("resources", {}).get("limits")
    return int((limits or {}).get("nvidia.com/gpu", 0))


@pytest.mark.parametrize(
    "spec", [GPU_PREFILL, GPU_DECODE, HUB_DECODE], ids=["prefill", "decode", "hub"]
)
def test_a_gpu_pool_rollout_never_asks_for_more_gpus_than_the_pool_has(
    spec: dict[str, Any],
) -> None:
    dep = _deployment(spec)
    replicas = dep["spec"]["replicas"]
    # At every step of the rollout: old + new pods together hold at most the pool's GPUs.
    assert (replicas + _surge(dep)) * _gpus(dep) == replicas * _gpus(dep) > 0
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


def test_a_cpu_pool_keeps_kubernetes_surge() -> None:
    for spec in (CPU_DECODE, CPU_PREFILL):
        dep = _deployment(spec)
        assert _gpus(dep) == 0
        assert dep["spec"]["strategy"]["rollingUpdate"] == {
            "maxSurge": "25%",
            "maxUnavailable": "25%",
        }
        assert _surge(dep) == 1


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        # A spare GPU exists and the pool must not lose capacity while it rolls.
        ({"maxSurge": 1, "maxUnavailable": 0}, {"maxSurge": 1, "maxUnavailable": 0}),
        # Asking never to lose a pod implies surging one.
        ({"maxUnavailable": 0}, {"maxSurge": 1, "maxUnavailable": 0}),
        ({"maxUnavailable": 2}, {"maxSurge": 0, "maxUnavailable": 2}),
        ({"maxSurge": 2}, {"maxSurge": 2, "maxUnavailable": 0}),
    ],
)
def test_the_strategy_is_overridable_per_pool(
    rollout: dict[str, int], expected: dict[str, int]
) -> None:
    dep = _deployment({**GPU_DECODE, "rollout": rollout})
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": expected}
    cpu = _deployment({**CPU_DECODE, "rollout": {"maxSurge": 0}})
    assert cpu["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": "25%"}
    recreate = _deployment({**GPU_DECODE, "rollout": {"type": "Recreate"}})
    assert recreate["spec"]["strategy"] == {"type": "Recreate"}


def _cr(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": spec,
    }


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"maxSurge": 0, "maxUnavailable": 0}, BOTH_ZERO),
        ({"type": "Recreate", "maxSurge": 1}, RECREATE_TAKES_NO_SURGE),
        ({"maxSurge": -1}, "maxSurge"),
        ({"drainSeconds": 7200}, "drainSeconds"),
    ],
)
def test_a_strategy_the_deployment_could_not_run_is_refused(
    rollout: dict[str, Any], message: str, crd_schemas: Any
) -> None:
    spec = {**GPU_DECODE, "rollout": rollout}
    with pytest.raises(ValidationError) as refused:
        ServingPoolSpec.model_validate(spec)
    assert message in str(refused.value)
    assert any(message in e for e in validate_cr(_cr(spec), crd_schemas))
    assert validate_cr(_cr({**GPU_DECODE, "rollout": {"maxSurge": 1}}), crd_schemas) == []


def _startup_budget_s(container: dict[str, Any]) -> int:
    probe = container["startupProbe"]
    return probe.get("initialDelaySeconds", 0) + probe["failureThreshold"] * probe["periodSeconds"]


@pytest.mark.parametrize(
    "spec", EVERY_POOL, ids=["prefill", "decode", "hub", "cpu-decode", "cpu-prefill"]
)
def test_the_progress_deadline_exceeds_the_startup_budget_for_every_role(
    spec: dict[str, Any],
) -> None:
    for dep in (
        _deployment(spec),
        _gateway_deployment(spec if spec["role"] == "prefill" else GPU_PREFILL),
    ):
        pod = dep["spec"]["template"]["spec"]
        deadline = dep["spec"].get("progressDeadlineSeconds", K8S_DEFAULT_PROGRESS_DEADLINE_S)
        # A pod may download first, then load for its whole startup budget: a normal load
        # is never flagged as a stalled rollout (status.py: ProgressDeadlineExceeded).
        assert deadline > max(_startup_budget_s(c) for c in pod["containers"])
        if pod.get("initContainers"):
            assert deadline >= _startup_budget_s(pod["containers"][0]) + 3600


def test_a_decode_pool_that_loads_a_70b_model_for_25_minutes_is_not_past_its_deadline() -> None:
    dep = _deployment(GPU_DECODE)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert _startup_budget_s(container) == 1800
    assert dep["spec"]["progressDeadlineSeconds"] > 25 * 60


def _flag(command: list[str], flag: str) -> int:
    return int(command[command.index(flag) + 1])


def _termination(dep: dict[str, Any]) -> tuple[int, int, list[str]]:
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    sleep_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    return (
        sleep_s,
        pod.get("terminationGracePeriodSeconds", K8S_DEFAULT_GRACE_S),
        container["command"],
    )


def test_every_role_drains_within_its_grace_period() -> None:
    # decode: vLLM drains its streams (--shutdown-timeout; its default 0 aborts them).
    sleep_s, grace_s, command = _termination(_deployment(GPU_DECODE))
    assert sleep_s > 0 and _flag(command, "--shutdown-timeout") >= 300
    assert grace_s > sleep_s + _flag(command, "--shutdown-timeout")
    # prefill: the server's HTTP drain, then its engine close (30 s).
    sleep_s, grace_s, command = _termination(_deployment(GPU_PREFILL))
    assert grace_s > sleep_s + _flag(command, "--drain-timeout") + 30
    # gateway: it relays decode's streams, so it drains as long as decode does.
    sleep_s, grace_s, command = _termination(_gateway_deployment())
    assert _flag(command, "--drain-timeout") >= 300
    assert grace_s > sleep_s + _flag(command, "--drain-timeout")


def test_the_drain_bound_is_the_pools_to_set() -> None:
    sleep_s, grace_s, command = _termination(
        _deployment({**GPU_DECODE, "rollout": {"drainSeconds": 1200}})
    )
    assert _flag(command, "--shutdown-timeout") == 1200 and grace_s > sleep_s + 1200
    # A decode pool that passes vLLM's flag itself keeps it, and the grace follows it.
    spec = {**GPU_DECODE, "vllmArgs": ["--shutdown-timeout=900"]}
    sleep_s, grace_s, command = _termination(_deployment(spec))
    assert command.count("--shutdown-timeout=900") == 1 and "--shutdown-timeout" not in command
    assert grace_s > sleep_s + 900
    sleep_s, grace_s, command = _termination(
        _deployment({**GPU_PREFILL, "rollout": {"drainSeconds": 5}})
    )
    assert _flag(command, "--drain-timeout") == 5 and grace_s > sleep_s + 5 + 30


@pytest.mark.parametrize("version", ["1.33", "1.37"])
def test_rollout_settings_render_valid_deployments(version: str) -> None:
    for spec in EVERY_POOL:
        for rollout in ({}, {"maxSurge": 1, "maxUnavailable": 0}, {"type": "Recreate"}):
            dep = _deployment({**copy.deepcopy(spec), "rollout": rollout})
            kubernetes_validate.validate(dep, version, strict=True)


def test_a_pool_with_its_own_image_does_not_roll_when_the_operators_default_changes() -> None:
    # The user's signal for an image upgrade: spec.image, changed pool by pool (docs/pods.md).
    upgraded = OperatorSettings(prefill_image="reg/prefill:0.2.0", decode_image="reg/decode:0.2.0")
    for spec in (GPU_PREFILL, GPU_DECODE):
        pinned = {**spec, "image": "reg/pinned:0.1.0"}
        before = build_pool_children(_pool(pinned), SETTINGS)
        assert build_pool_children(_pool(pinned), upgraded) == before
        # An unpinned pool follows the default: its template changes, so it rolls.
        assert build_pool_children(_pool(spec), upgraded) != build_pool_children(
            _pool(spec), SETTINGS
        )
