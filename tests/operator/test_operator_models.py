"""CRDs: generated from the models, structural, documented, and enforcing their rules."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from flowprefill_operator.crd import KINDS, build_crd, stale_files
from flowprefill_operator.models import ServingPoolSpec, SLOClassSpec
from pydantic import ValidationError

from tests.operator.conftest import load_docs
from tests.operator.crdcheck import validate_cr

K8S_VERSION = "1.33"


def test_crd_files_are_generated_from_the_models(repo_root: Path) -> None:
    stale = stale_files(repo_root)
    assert not stale, (
        f"stale CRDs {stale}: run `python -m flowprefill_operator crdgen` from the repo root"
    )


def test_staleness_check_notices_an_edit(tmp_path: Path, repo_root: Path) -> None:
    from flowprefill_operator.crd import write_crds

    write_crds(tmp_path)
    assert stale_files(tmp_path) == []
    victim = tmp_path / "crds" / f"{KINDS[0].crd_name}.yaml"
    victim.write_text(victim.read_text().replace("ttftSloMs", "ttftSlo"))
    assert stale_files(tmp_path) == [victim]


def _walk(schema: dict[str, Any], path: str = ""):  # type: ignore[no-untyped-def]
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_crd_schema_is_structural_and_documented(kind: Any) -> None:
    crd = build_crd(kind)
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)  # raises when invalid
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert "type" in node, f"{path} has no type (not structural)"
        for banned in ("$ref", "anyOf", "allOf", "oneOf", "title", "nullable"):
            assert banned not in node, f"{path} uses {banned}"
        if path.startswith((".spec", ".status")) and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description (kubectl explain)"


def test_servingpool_scale_and_printer_columns() -> None:
    crd = build_crd(next(k for k in KINDS if k.kind == "ServingPool"))
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == [
        "Service", "Role", "Desired", "Current", "Ready", "Owner", "Phase", "Last-Decision", "Age"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        "slo-classes.yaml",
        "llama3-8b.yaml",
        "llama3-8b-hpa.yaml",
        "llama3-70b-tp.yaml",
        "llama3-8b-autoscaled.yaml",
    ],
)
def test_examples_validate(name: str, repo_root: Path, crd_schemas: Any) -> None:
    for doc in load_docs(repo_root / "examples" / name):
        if doc["apiVersion"].startswith("flowprefill.io/"):
            assert validate_cr(doc, crd_schemas) == [], doc["metadata"]["name"]
            model = SLOClassSpec if doc["kind"] == "SLOClass" else ServingPoolSpec
            model.model_validate(doc["spec"])
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_examples_cover_the_papers_four_task_types(repo_root: Path) -> None:
    docs = load_docs(repo_root / "examples" / "slo-classes.yaml")
    targets = {d["spec"]["taskType"]: d["spec"]["ttftSloMs"] for d in docs}
    assert targets == {"text": 250, "image": 500, "search": 4000, "file": 6000}
    assert [d["metadata"]["name"] for d in docs if d["spec"].get("default")] == ["chat"]
    pools = [
        d
        for d in load_docs(repo_root / "examples" / "llama3-8b.yaml")
        if d["kind"] == "ServingPool"
    ]
    assert {(p["spec"]["service"], p["spec"]["role"]) for p in pools} == {
        ("llama3-8b", "prefill"),
        ("llama3-8b", "decode"),
    }


def _pool(**spec: Any) -> dict[str, Any]:
    base = {"service": "m", "role": "prefill", "model": {"path": "/models/m"}}
    return {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "m-prefill", "namespace": "ns"},
        "spec": {**base, **spec},
    }


# (spec overrides, the message the API server would answer with)
BAD_POOLS = [
    ({"role": "router"}, "role"),
    ({"replicas": -1}, "replicas"),
    ({"replicas": "two"}, "replicas"),
    ({"service": "Bad_Name"}, "service"),
    ({"engine": {"granularity": "token"}}, "granularity"),
    ({"engine": {"batchTokenBudget": 0}}, "batchTokenBudget"),
    ({"engine": {"chunkSize": 8192, "batchTokenBudget": 4096}}, "chunkSize must not exceed"),
    (
        {"engine": {"tpSize": 4}, "resources": {"gpusPerPod": 2}},
        "engine.tpSize must not exceed resources.gpusPerPod",
    ),
    ({"resources": {"gpusPerPod": 0}}, "engine.tpSize must not exceed resources.gpusPerPod"),
    ({"engine": {"tpSize": 9}, "resources": {"gpusPerPod": 16}}, "tpSize"),
    ({"engine": {"tpSize": 0}}, "tpSize"),
    (
        {"role": "decode", "vllm": {"tensorParallelSize": 4}, "resources": {"gpusPerPod": 2}},
        "vllm.tensorParallelSize must not exceed resources.gpusPerPod",
    ),
    ({"role": "decode", "vllm": {"tensorParallelSize": 0}}, "tensorParallelSize"),
    ({"vllm": {"tensorParallelSize": 1}}, "vllm applies to role=decode"),
    (
        {"role": "decode", "vllmArgs": ["--tensor-parallel-size=2"]},
        "not in vllmArgs",
    ),
    ({"role": "decode", "vllmArgs": ["-tp", "2"]}, "not in vllmArgs"),
    ({"role": "decode", "engine": {}}, "engine applies to role=prefill"),
    ({"vllmArgs": ["--foo"]}, "vllmArgs applies to role=decode"),
    (
        {"model": {"path": "/models-other/m", "image": {"reference": "x"}}},
        "path must be image.mountPath or a directory under it",
    ),
    ({"model": {"uri": "pvc://w", "image": {"reference": "x"}}}, "at most one of uri and image"),
    ({"model": {"uri": "hf://org/name", "path": "/m"}}, "exactly one of uri"),
    ({"engine": {"batching": "biggest-first"}}, "batching"),
    # Unset transport: sharedDir on a CPU pool (nixl on a GPU pool: test_operator_nixl.py).
    (
        {"kvHandoff": {}, "engine": {"device": "cpu"}, "resources": {"gpusPerPod": 0}},
        "claimName is required with transport sharedDir",
    ),
    ({"kvHandoff": {"transport": "http", "claimName": "kv"}}, "not used with http"),
    ({"kvHandoff": {"claimName": "kv", "sizeLimit": "1Gi"}}, "sizeLimit applies to"),
    ({"kvHandoff": {"transport": "nixl", "budget": "1Gi"}}, "budget applies to"),
    ({"kvHandoff": {"transport": "nfs"}}, "transport"),
    ({"kvHandoff": {"transport": "http", "maxAgeSeconds": 1}}, "maxAgeSeconds"),
    ({"unknownField": 1}, "unknownField"),
    ({"replicasOwner": "operator"}, "replicasOwner operator needs an autoscaling block"),
    ({"replicasOwner": "hpa"}, "replicasOwner"),
    ({"autoscaling": {"minReplicas": 1}}, "maxReplicas"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas must not exceed"),
    (
        {"autoscaling": {"maxReplicas": 4, "shortWindowSeconds": 600, "longWindowSeconds": 600}},
        "shortWindowSeconds must be shorter",
    ),
    (
        {"autoscaling": {"maxReplicas": 4, "scaleUpBurnRate": 1, "scaleDownBurnRate": 1}},
        "scaleDownBurnRate must be lower",
    ),
    ({"autoscaling": {"maxReplicas": 4, "longWindowSeconds": 86_400}}, "longWindowSeconds"),
    ({"autoscaling": {"maxReplicas": 4, "gpuBudget": -1}}, "gpuBudget"),
    (
        {"autoscaling": {"maxReplicas": 4, "tpotUpRatio": 0.5, "tpotDownRatio": 0.6}},
        "tpotDownRatio must be lower",
    ),
]


@pytest.mark.parametrize(("override", "message"), BAD_POOLS, ids=[m for _, m in BAD_POOLS])
def test_bad_pools_are_refused_by_schema_cel_and_model(
    override: dict[str, Any], message: str, crd_schemas: Any
) -> None:
    obj = _pool(**override)
    errors = validate_cr(obj, crd_schemas)
    if message != "unknownField":  # the API server prunes unknown fields instead
        assert any(message in e for e in errors), errors
    # The operator's parser refuses the same objects (for servers that admitted them).
    with pytest.raises(ValidationError):
        ServingPoolSpec.model_validate(obj["spec"])


GOOD_TP_POOLS = [
    {"engine": {"tpSize": 4}, "resources": {"gpusPerPod": 4}},
    {"engine": {"tpSize": 8}, "resources": {"gpusPerPod": 8}},
    {"engine": {"tpSize": 2}, "resources": {"gpusPerPod": 4}},  # spare GPUs idle
    {"engine": {"tpSize": 2, "device": "cpu"}, "resources": {"gpusPerPod": 0}},  # CPU ranks
    {"role": "decode", "vllm": {"tensorParallelSize": 4}, "resources": {"gpusPerPod": 4}},
    {"role": "decode", "vllm": {"tensorParallelSize": 2}, "resources": {"gpusPerPod": 0}},
]


@pytest.mark.parametrize("spec", GOOD_TP_POOLS, ids=str)
def test_tensor_parallel_pools_within_their_gpus_are_admitted(
    spec: dict[str, Any], crd_schemas: Any
) -> None:
    obj = _pool(**spec)
    assert validate_cr(obj, crd_schemas) == []
    parsed = ServingPoolSpec.model_validate(obj["spec"])
    assert parsed.tensor_parallel_size == (
        spec.get("engine", {}).get("tpSize") or spec["vllm"]["tensorParallelSize"]
    )


def test_more_ranks_than_gpus_is_refused_naming_both_fields(crd_schemas: Any) -> None:
    """The API server (CEL) and the operator's parse answer with the same message."""
    obj = _pool(engine={"tpSize": 4}, resources={"gpusPerPod": 2})
    (error,) = validate_cr(obj, crd_schemas)
    assert "engine.tpSize" in error and "resources.gpusPerPod" in error
    with pytest.raises(ValidationError) as exc:
        ServingPoolSpec.model_validate(obj["spec"])
    message = str(exc.value)
    assert "engine.tpSize must not exceed resources.gpusPerPod" in message
    assert "(engine.tpSize=4, resources.gpusPerPod=2)" in message


def test_the_crd_admits_exactly_the_engines_tp_sizes(crd_schemas: Any) -> None:
    from flowprefill.contracts.engine import MAX_TP_SIZE

    def refused(tp: int) -> bool:
        obj = _pool(engine={"tpSize": tp}, resources={"gpusPerPod": 16})
        return bool(validate_cr(obj, crd_schemas))

    assert [tp for tp in range(0, 12) if not refused(tp)] == list(range(1, MAX_TP_SIZE + 1))
    with pytest.raises(ValidationError, match=r"tpSize"):
        ServingPoolSpec.model_validate(
            _pool(engine={"tpSize": MAX_TP_SIZE + 1}, resources={"gpusPerPod": 16})["spec"]
        )


def test_good_pool_passes_both(crd_schemas: Any) -> None:
    obj = _pool(engine={"chunkSize": 2048}, resources={"gpusPerPod": 1})
    assert validate_cr(obj, crd_schemas) == []
    ServingPoolSpec.model_validate(obj["spec"])


def test_autoscaled_pool_passes_both_with_defaults(crd_schemas: Any) -> None:
    obj = _pool(replicasOwner="operator", autoscaling={"maxReplicas": 8, "gpuBudget": 16})
    assert validate_cr(obj, crd_schemas) == []
    spec = ServingPoolSpec.model_validate(obj["spec"])
    assert spec.autoscaling is not None
    assert (spec.autoscaling.min_replicas, spec.autoscaling.long_window_seconds) == (1, 3600)
    # Unset owner: external, as before the field existed (an HPA keeps its pool).
    assert ServingPoolSpec.model_validate(_pool()["spec"]).replicas_owner == "external"


def test_role_and_service_are_immutable(crd_schemas: Any) -> None:
    old = _pool()
    new = copy.deepcopy(old)
    new["spec"]["role"] = "decode"
    assert any("role is immutable" in e for e in validate_cr(new, crd_schemas, old=old))
    scaled = copy.deepcopy(old)
    scaled["spec"]["replicas"] = 5
    assert validate_cr(scaled, crd_schemas, old=old) == []


def test_pool_name_rules(crd_schemas: Any) -> None:
    obj = _pool()
    obj["metadata"]["name"] = "m-gateway"  # runs as m-gateway-pool (test_operator_gateway_ha)
    assert validate_cr(obj, crd_schemas) == []
    obj["metadata"]["name"] = "M"
    assert any("DNS-1035" in e for e in validate_cr(obj, crd_schemas))


def _slo(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "SLOClass",
        "metadata": {"name": "chat", "namespace": "ns"},
        "spec": {"taskType": "text", "ttftSloMs": 250, **spec},
    }


BAD_CLASSES = [
    ({"ttftSloMs": 0}, "ttftSloMs"),
    ({"taskType": "video"}, "taskType"),
    ({"attainmentTarget": 0}, "attainmentTarget"),
    ({"attainmentTarget": 1.5}, "attainmentTarget"),
    ({"priority": 5000}, "priority"),
    ({"match": {"apiKeyHashes": ["plaintext-key"]}}, "apiKeyHashes"),
    ({"match": {"headers": [{"name": "X-Upper", "value": "v"}]}}, "headers"),
    (
        {"match": {"apiKeyHashes": ["a" * 64], "apiKeySecretRef": {"name": "s"}}},
        "either apiKeyHashes or apiKeySecretRef",
    ),
]


@pytest.mark.parametrize(("override", "message"), BAD_CLASSES, ids=[m for _, m in BAD_CLASSES])
def test_bad_classes_are_refused(override: dict[str, Any], message: str, crd_schemas: Any) -> None:
    obj = _slo(**override)
    errors = validate_cr(obj, crd_schemas)
    assert any(message in e for e in errors), errors
    with pytest.raises(ValidationError):
        SLOClassSpec.model_validate(obj["spec"])


def test_engine_settings_offer_exactly_the_engines_policies() -> None:
    from typing import get_args

    from flowprefill_operator.models.servingpool import Batching, Policy

    from flowprefill.prefill.scheduler.batching import BATCHING
    from flowprefill.prefill.scheduler.policies import POLICIES

    assert set(get_args(Batching)) == set(BATCHING)
    assert set(get_args(Policy)) == set(POLICIES)
