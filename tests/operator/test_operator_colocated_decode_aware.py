"""Decode-aware preemption in a ``role: colocated`` pool (``spec.colocated.decodeAware``):
the engine's ``decode_aware`` settings and vLLM's beat connector rendered to meet at the
pod's one beat socket, in the pod's writable scratch; off when unset; the CRD's rules."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from flowprefill_operator.builders import PoolRef, build_pool_children
from flowprefill_operator.colocated import LaunchSpec
from flowprefill_operator.models import ServingPoolSpec
from flowprefill_operator.settings import OperatorSettings
from pydantic import ValidationError

from flowprefill.contracts import EngineConfig
from flowprefill.contracts.beats import BEAT_CONNECTOR, BEAT_CONNECTOR_MODULE, SOCKET_KEY
from flowprefill.contracts.deployment import COLOCATED_BEAT_SOCKET
from flowprefill.contracts.engine import DEFAULT_TBT_TARGET_S
from tests.operator.crdcheck import validate_cr

SETTINGS = OperatorSettings()
SPEC: dict[str, Any] = {
    "service": "m",
    "role": "colocated",
    "model": {"path": "/models/m"},
    "resources": {"gpusPerPod": 1},
}


def render(colocated: dict[str, Any] | None) -> tuple[EngineConfig, dict[str, Any], list[str]]:
    """(engine.json, the pod's container, decode's argv) of a colocated pool."""
    spec = SPEC | ({"colocated": colocated} if colocated is not None else {})
    ref = PoolRef("m-colo", "ns", "uid-c", ServingPoolSpec.model_validate(spec))
    cm, dep, _ = build_pool_children(ref, SETTINGS)
    for manifest in (cm, dep):
        kubernetes_validate.validate(manifest, "1.33", strict=True)
    engine = EngineConfig.model_validate_json(cm["data"]["engine.json"])
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    launch = LaunchSpec.parse(container["command"][4])
    return engine, container, launch.decode.argv


def kv_config(argv: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config


def test_decode_aware_meets_at_one_socket_in_the_pods_scratch() -> None:
    engine, container, argv = render({"decodeAware": {"tbtTargetSeconds": 0.2, "rule": "mean"}})
    aware = engine.decode_aware
    assert aware is not None
    assert (aware.socket_path, aware.tbt_target_s, aware.rule) == (
        COLOCATED_BEAT_SOCKET,
        0.2,
        "mean",
    )
    # vLLM keeps NIXL first (it alone answers what is loaded) and beats to the same socket.
    config = kv_config(argv)
    assert config["kv_connector"] == "MultiConnector"
    nixl, beats = config["kv_connector_extra_config"]["connectors"]
    assert nixl["kv_connector"] == "NixlConnector"
    assert (beats["kv_connector"], beats["kv_connector_module_path"]) == (
        BEAT_CONNECTOR,
        BEAT_CONNECTOR_MODULE,
    )
    assert beats["kv_connector_extra_config"][SOCKET_KEY] == COLOCATED_BEAT_SOCKET
    # The socket lives on a writable mount both processes of the one container see (the
    # root filesystem is read-only).
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(COLOCATED_BEAT_SOCKET.startswith(m.rstrip("/") + "/") for m in mounts), mounts


def test_decode_aware_defaults_to_the_tightest_paper_target() -> None:
    engine, _, _ = render({"decodeAware": {}})
    assert engine.decode_aware is not None
    assert (engine.decode_aware.tbt_target_s, engine.decode_aware.rule) == (
        DEFAULT_TBT_TARGET_S,
        "gap",
    )


@pytest.mark.parametrize("colocated", [None, {}, {"decodeMemoryFraction": 0.5}])
def test_off_unless_asked(colocated: dict[str, Any] | None) -> None:
    engine, _, argv = render(colocated)
    assert engine.decode_aware is None
    assert BEAT_CONNECTOR not in json.dumps(kv_config(argv))


def test_the_rendered_beat_connector_is_a_valid_vllm_config() -> None:
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _, _, argv = render({"decodeAware": {}})
    config = KVTransferConfig(**kv_config(argv))
    assert config.kv_connector == "MultiConnector" and config.is_kv_consumer
    beats = config.kv_connector_extra_config["connectors"][1]
    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**beats))
    assert cls.__name__ == "FlowPrefillBeatConnector"


def _cr(colocated: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "m-colo", "namespace": "ns"},
        "spec": SPEC | {"colocated": colocated},
    }


@pytest.mark.parametrize(
    "colocated",
    [{"decodeAware": {}}, {"decodeAware": {"tbtTargetSeconds": 0.05, "rule": "gap"}}],
    ids=str,
)
def test_admitted(colocated: dict[str, Any], crd_schemas: Any) -> None:
    obj = _cr(colocated)
    assert validate_cr(obj, crd_schemas) == []
    ServingPoolSpec.model_validate(obj["spec"])


BAD = [
    ({"decodeAware": {"tbtTargetSeconds": 0}}, "tbtTargetSeconds"),
    ({"decodeAware": {"tbtTargetSeconds": 120}}, "tbtTargetSeconds"),
    ({"decodeAware": {"rule": "median"}}, "rule"),
]
# The socket is the operator's to choose (one per pod), not a field: the API server prunes an
# unknown field, and the operator's model refuses it by name.


@pytest.mark.parametrize(("colocated", "field"), BAD, ids=str)
def test_refused_naming_the_field(colocated: dict[str, Any], field: str, crd_schemas: Any) -> None:
    obj = _cr(colocated)
    errors = validate_cr(obj, crd_schemas)
    assert any(field in e for e in errors), errors
    with pytest.raises(ValidationError, match=field):
        ServingPoolSpec.model_validate(obj["spec"])


def test_the_socket_is_not_a_field() -> None:
    with pytest.raises(ValidationError, match="socketPath"):
        ServingPoolSpec.model_validate(_cr({"decodeAware": {"socketPath": "/x"}})["spec"])
