"""The KV a prefill pod holds for decode is bounded by ``kvHandoff.budget``: it reaches
engine.json (the engine refuses hand-offs past it, decode recomputes), and with ``http``
the pod's emptyDir and ephemeral-storage request are sized above it, so the budget acts
before the kubelet would evict the pod."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from flowprefill_operator.builders import PoolRef, build_pool_children
from flowprefill_operator.models import ServingPoolSpec
from flowprefill_operator.settings import OperatorSettings

from flowprefill.contracts import EngineConfig

BASE = {
    "service": "svc",
    "role": "prefill",
    "model": {"path": "/models/m", "image": {"reference": "reg/m@sha256:" + "0" * 64}},
    "engine": {"device": "cpu"},
    "resources": {"gpusPerPod": 0, "cpu": "4", "memory": "16Gi"},
}


def _children(kv: dict[str, Any], role: str = "prefill") -> list[dict[str, Any]]:
    wire = {**BASE, "role": role, "kvHandoff": kv}
    if role == "decode":
        del wire["engine"]  # the engine block is prefill's
    spec = ServingPoolSpec.model_validate(wire)
    return build_pool_children(PoolRef("p", "ns", "u", spec), OperatorSettings())


def _engine(children: list[dict[str, Any]]) -> EngineConfig:
    (cm,) = [c for c in children if c["kind"] == "ConfigMap" and "engine.json" in c["data"]]
    return EngineConfig.model_validate(json.loads(cm["data"]["engine.json"]))


def _pod(children: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [c for c in children if c["kind"] == "Deployment"]
    kubernetes_validate.validate(dep, "1.33", strict=True)
    pod: dict[str, Any] = dep["spec"]["template"]["spec"]
    return pod


def _mi(quantity: str) -> int:
    assert quantity.endswith("Mi"), quantity
    return int(quantity[:-2])


@pytest.mark.parametrize(
    ("kv", "budget_mib", "size_limit"),
    [
        ({"transport": "http"}, 8192, "9012Mi"),  # default 8Gi, + a tenth
        ({"transport": "http", "budget": "2Gi"}, 2048, "2304Mi"),  # + 256Mi at least
        ({"transport": "http", "sizeLimit": "10Gi"}, 9216, "10Gi"),  # 90 % of the volume
        ({"transport": "http", "budget": "1Gi", "sizeLimit": "4Gi"}, 1024, "4Gi"),
    ],
)
def test_http_budget_reaches_the_engine_and_sizes_the_pods_disk(
    kv: dict[str, Any], budget_mib: int, size_limit: str
) -> None:
    for role in ("prefill", "decode"):
        children = _children(kv, role)
        pod = _pod(children)
        (volume,) = [v for v in pod["volumes"] if v["name"] == "kv"]
        assert volume["emptyDir"] == {"sizeLimit": size_limit}
        requests = pod["containers"][0]["resources"]["requests"]
        assert requests["ephemeral-storage"] == size_limit
        # a request, not a limit: the sizeLimit bounds the volume, the budget keeps it below
        assert "ephemeral-storage" not in pod["containers"][0]["resources"]["limits"]
    engine = _engine(_children(kv))
    assert engine.kv is not None and engine.kv.budget_mb == budget_mib
    if size_limit.endswith("Mi"):
        assert _mi(size_limit) > budget_mib


def test_shared_dir_budget_reaches_the_engine_without_a_local_disk_request() -> None:
    children = _children({"claimName": "kv", "budget": "64Gi"})
    engine = _engine(children)
    assert engine.kv is not None and engine.kv.budget_mb == 64 * 1024
    assert "ephemeral-storage" not in _pod(children)["containers"][0]["resources"]["requests"]


def test_nixl_budget_is_its_buffer() -> None:
    children = _children({"transport": "nixl", "nixl": {"bufferMiB": 1024}})
    engine = _engine(children)
    assert engine.kv is not None and engine.kv.nixl is not None
    assert engine.kv.nixl.buffer_mb == 1024
    assert not any(v["name"] == "kv" for v in _pod(children).get("volumes", []))
