"""Model sources in the pods the builders render: what each role mounts, the download
step, where the token goes, and how a failed download reads back into the pool's status."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from flowprefill_operator.builders import (
    PoolRef,
    build_gateway_children,
    build_pool_children,
    build_slo_table,
)
from flowprefill_operator.controllers.modelcheck import ModelChecks
from flowprefill_operator.models import ServingPoolSpec
from flowprefill_operator.settings import OperatorSettings
from flowprefill_operator.status import pod_problems
from pydantic import ValidationError

from flowprefill.contracts.model_uri import HubSource
from flowprefill.fetch import FetchFailure

SETTINGS = OperatorSettings(hf_endpoint="https://hub.mirror.example")
HF = "hf://meta-llama/Llama-3.1-8B-Instruct@v1.0"
LOCAL = "/var/cache/flowprefill/models/hf/meta-llama/Llama-3.1-8B-Instruct/v1.0"


def spec(role: str = "prefill", **model: Any) -> ServingPoolSpec:
    return ServingPoolSpec.model_validate(
        {"service": "llama", "role": role, "model": model, "resources": {"gpusPerPod": 1}}
    )


def deployment(s: ServingPoolSpec, name: str = "llama-prefill") -> dict[str, Any]:
    children = build_pool_children(PoolRef(name, "ns", "uid", s), SETTINGS)
    dep = next(m for m in children if m["kind"] == "Deployment")
    for version in ("1.30", "1.33", "1.35"):
        kubernetes_validate.validate(dep, version, strict=True)
    return dep


def gateway_pod(*pools: ServingPoolSpec) -> dict[str, Any]:
    refs = [PoolRef(f"llama-{s.role}", "ns", f"uid-{s.role}", s) for s in pools]
    children = build_gateway_children(refs, build_slo_table([], [None], {}, {}), SETTINGS)
    dep = next(m for m in children if m["kind"] == "Deployment")
    kubernetes_validate.validate(dep, "1.33", strict=True)
    pod: dict[str, Any] = dep["spec"]["template"]["spec"]
    return pod


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_hub_source_downloads_in_an_init_step_and_serves_offline() -> None:
    s = spec(uri=HF, tokenSecretRef={"name": "hf", "key": "token"}, cache={"sizeLimit": "40Gi"})
    pod = deployment(s)["spec"]["template"]["spec"]
    (step,) = pod["initContainers"]
    (main,) = pod["containers"]
    assert step["name"] == "fetch-model"
    assert step["image"] == main["image"] == SETTINGS.prefill_image
    assert step["command"] == ["flowprefill", "fetch-model", HF, "--dest", LOCAL]
    step_env, main_env = env_of(step), env_of(main)
    # The token reaches the download step alone, never the engine.
    assert step_env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert "HF_TOKEN" not in main_env
    assert step_env["HF_ENDPOINT"] == "https://hub.mirror.example"
    assert step_env["HF_HUB_OFFLINE"] == "0" and main_env["HF_HUB_OFFLINE"] == "1"
    assert step["terminationMessagePolicy"] == "FallbackToLogsOnError"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {"sizeLimit": "40Gi"}}
    assert {"name": "model-cache", "mountPath": "/var/cache/flowprefill/models",
            "readOnly": True} in main["volumeMounts"]  # fmt: skip
    assert "model-cache" in {m["name"] for m in step["volumeMounts"]}
    engine = next(
        m for m in build_pool_children(PoolRef("p", "ns", "u", s), SETTINGS)
        if m["kind"] == "ConfigMap"
    )  # fmt: skip
    assert f'"model_path": "{LOCAL}"' in engine["data"]["engine.json"]


def test_decode_loads_the_same_download_and_the_cache_can_be_a_claim() -> None:
    s = spec("decode", uri=HF, cache={"claimName": "models-rwx"})
    pod = deployment(s, "llama-decode")["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[command.index("--model") + 1] == LOCAL
    assert pod["initContainers"][0]["image"] == SETTINGS.decode_image
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "models-rwx"}


def test_ephemeral_cache_is_a_claim_per_pod() -> None:
    s = spec(uri=HF, cache={"ephemeral": {"size": "60Gi", "storageClassName": "premium-rwo"}})
    volumes = {v["name"]: v for v in deployment(s)["spec"]["template"]["spec"]["volumes"]}
    claim = volumes["model-cache"]["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "60Gi"}},
        "storageClassName": "premium-rwo",
    }


def test_claim_source_is_mounted_read_only_with_its_sub_path() -> None:
    pod = deployment(spec(uri="pvc://weights/llama/8b"))["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True,
                     "subPath": "llama/8b"}  # fmt: skip


def test_gateway_gets_tokenizer_files_never_the_weights() -> None:
    prefill = spec(uri=HF, tokenSecretRef={"name": "hf"})
    pod = gateway_pod(prefill, spec("decode", uri=HF))
    assert {v["name"] for v in pod["volumes"]} == {"config", "slo", "tmp", "tokenizer"}
    (step,) = pod["initContainers"]
    assert step["command"][-1] == "--tokenizer-only"
    assert env_of(step)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    # A claim source with the tokenizer from the Hub: still no weights volume.
    claimed = spec(uri="pvc://weights/llama", tokenizerUri="hf://meta-llama/Llama-3.1-8B-Instruct")
    pod = gateway_pod(claimed)
    assert "model" not in {v["name"] for v in pod["volumes"]}
    # Without tokenizerUri a claim is shared read-only (it must then allow a second reader).
    pod = gateway_pod(spec(uri="pvc://weights/llama"))
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["readOnly"] is True


def test_no_child_hard_codes_a_uid() -> None:
    for s in (spec(uri=HF), spec("decode", uri="pvc://w"), spec(path="tiny-llama")):
        pod = deployment(s)["spec"]["template"]["spec"]
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        for c in [*pod["containers"], *pod.get("initContainers", [])]:
            assert not {"runAsUser", "runAsGroup"} & set(c["securityContext"])


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"uri": HF, "path": "/m"}, "exactly one of uri"),
        ({}, "exactly one of uri"),
        ({"uri": "pvc://w", "cache": {"sizeLimit": "1Gi"}}, "cache applies to uri hf://"),
        ({"path": "/m", "tokenSecretRef": {"name": "t"}}, "tokenSecretRef applies"),
        ({"uri": HF, "cache": {"claimName": "c", "ephemeral": {"size": "1Gi"}}}, "at most one"),
        ({"path": "/models-other/x", "image": {"reference": "r"}}, "path must be image.mountPath"),
        ({"uri": "s3://bucket/llama"}, "String should match pattern"),
        ({"uri": "pvc://w/../etc"}, "String should match pattern"),
    ],
)
def test_model_rules(model: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(**model)


def test_hub_ids_the_old_path_pattern_refused_are_sources_now() -> None:
    for uri in (HF, "hf://gpt2", "hf://org/name@refs/pr/1", "hf://Qwen/Qwen2.5-0.5B"):
        assert spec(uri=uri).model.hub is not None


def pod_status(state: dict[str, Any], *, last: dict[str, Any] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"name": "fetch-model", "state": state}
    if last:
        status["lastState"] = last
    return {
        "metadata": {"name": "llama-prefill-abc"},
        "status": {"initContainerStatuses": [status]},
    }


def test_a_failed_download_step_reads_back_with_its_reason() -> None:
    message = "ModelGated: hf://meta-llama/Llama-3.1-8B-Instruct is gated and ..."
    backing_off = pod_status(
        {"waiting": {"reason": "CrashLoopBackOff"}},
        last={"terminated": {"exitCode": 2, "message": message}},
    )
    (problem,) = pod_problems([backing_off])
    assert problem.reason == "ModelGated"
    assert "llama-prefill-abc" in problem.message and "hf://meta-llama" in problem.message
    # Killed before it wrote its reason (e.g. OOM): the log's last line, generic reason.
    killed = pod_status({"terminated": {"exitCode": 137, "message": "Downloading\nKilled"}})
    assert [(p.reason, p.message.rsplit(": ", 1)[1]) for p in pod_problems([killed])] == [
        ("ModelDownloadFailed", "Killed")
    ]
    assert pod_problems([pod_status({"running": {}})]) == []


def test_model_checks_are_remembered_and_inconclusive_ones_let_pods_try() -> None:
    calls: list[str] = []
    now = [0.0]
    answers = {
        "hf://gone/model": FetchFailure("ModelRepositoryNotFound", "gone", permanent=True),
        "hf://slow/model": FetchFailure("ModelDownloadFailed", "timed out", permanent=False),
    }

    def checker(source: HubSource, **_: Any) -> FetchFailure | None:
        calls.append(source.uri)
        return answers.get(source.uri)

    checks = ModelChecks(checker, clock=lambda: now[0])
    gone, slow, ok = HubSource("gone/model"), HubSource("slow/model"), HubSource("ok/model")
    assert checks.hub(gone, None, "", None) == answers["hf://gone/model"]
    assert checks.hub(slow, None, "", None) is None
    assert checks.hub(ok, "t", "", None) is None
    assert checks.hub(gone, None, "", None) is not None and len(calls) == 3  # remembered
    assert checks.hub(ok, "other-token", "", None) is None and len(calls) == 4  # new token
    now[0] = 61.0  # failures are asked again within a minute, successes kept longer
    checks.hub(gone, None, "", None)
    checks.hub(ok, "t", "", None)
    assert calls[4:] == ["hf://gone/model"]


OVERLAY: dict[str, Any] = {
    "labels": {"team": "search"},
    "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
    "serviceAccountName": "llama-sa",
    "imagePullSecrets": [{"name": "team-registry"}],
    "priorityClassName": "inference-high",
    "runtimeClassName": "nvidia",
    "schedulerName": "volcano",
    "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}
                ]
            }
        }
    },
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
         "whenUnsatisfiable": "ScheduleAnyway"}
    ],
    "securityContext": {"fsGroup": 2000},
    "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
    "envFrom": [{"secretRef": {"name": "extra"}}],
    "volumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
    "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}],
}  # fmt: skip


def test_rendered_pods_carry_pull_secrets_and_every_overlay_field() -> None:
    settings = SETTINGS.model_copy(update={"child_image_pull_secrets": ("registry-creds",)})
    raw = {
        "service": "llama",
        "role": "prefill",
        "model": {"uri": HF},
        "pod": OVERLAY,
        "gatewayPod": {"serviceAccountName": "gw-sa", "imagePullSecrets": [{"name": "gw"}]},
    }
    s = ServingPoolSpec.model_validate(raw)  # fmt: skip
    children = build_pool_children(PoolRef("llama-prefill", "ns", "u", s), settings)
    dep = next(m for m in children if m["kind"] == "Deployment")
    kubernetes_validate.validate(dep, "1.33", strict=True)
    template = dep["spec"]["template"]
    pod = template["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}, {"name": "team-registry"}]
    for key in ("serviceAccountName", "priorityClassName", "runtimeClassName", "schedulerName",
                "affinity", "topologySpreadConstraints"):  # fmt: skip
        assert pod[key] == OVERLAY[key], key
    assert template["metadata"]["labels"]["team"] == "search"
    assert template["metadata"]["labels"]["flowprefill.io/pool"] == "llama-prefill"
    assert pod["nodeSelector"] == OVERLAY["nodeSelector"]
    assert OVERLAY["tolerations"][0] in pod["tolerations"]
    assert pod["securityContext"]["fsGroup"] == 2000 and pod["securityContext"]["runAsNonRoot"]
    for container in [*pod["containers"], *pod["initContainers"]]:
        assert env_of(container)["HTTPS_PROXY"] == "http://proxy:3128"  # downloads too
        assert {"secretRef": {"name": "extra"}} in container["envFrom"]
    assert {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True} in pod["containers"][0][
        "volumeMounts"
    ]
    gateway = next(
        m
        for m in build_gateway_children(
            [PoolRef("llama-prefill", "ns", "u", s)], build_slo_table([], [None], {}, {}), settings
        )
        if m["kind"] == "Deployment"
    )["spec"]["template"]["spec"]
    assert gateway["serviceAccountName"] == "gw-sa"
    assert gateway["imagePullSecrets"] == [{"name": "registry-creds"}, {"name": "gw"}]
    assert "team" not in gateway.get("nodeSelector", {})


def test_an_overlay_mount_over_the_operators_is_refused_by_the_builder() -> None:
    from flowprefill_operator.builders.overlay import OverlayConflict

    raw = {"service": "llama", "role": "prefill", "model": {"uri": HF},
           "pod": {"volumes": [{"name": "x", "emptyDir": {}}],
                   "volumeMounts": [{"name": "x", "mountPath": "/tmp"}]}}  # fmt: skip
    s = ServingPoolSpec.model_validate(raw)
    with pytest.raises(OverlayConflict, match="/tmp"):
        build_pool_children(PoolRef("p", "ns", "u", s), SETTINGS)
    assert build_pool_children(PoolRef("p", "ns", "u", s), SETTINGS, overlay=False)


PROVISIONED_EVERYWHERE = {"emptyDir", "configMap", "secret", "projected", "downwardAPI"}


def example_pools() -> list[PoolRef]:
    import yaml

    from tests.operator.crdcheck import ROOT

    pools = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == "PersistentVolumeClaim":
                # A claim a managed cluster's default class cannot make (ReadOnlyMany on
                # EBS/PD/Azure Disk), or one that would start empty and read-only.
                assert doc["spec"]["accessModes"] == ["ReadWriteOnce"], path.name
            if doc and doc["kind"] == "ServingPool":
                spec_ = ServingPoolSpec.model_validate(doc["spec"])
                pools.append(PoolRef(doc["metadata"]["name"], "ns", "u", spec_))
    return pools


def test_examples_use_sources_a_managed_cluster_provisions() -> None:
    pools = example_pools()
    assert pools
    for ref in pools:
        dep = next(m for m in build_pool_children(ref, SETTINGS) if m["kind"] == "Deployment")
        for volume in dep["spec"]["template"]["spec"]["volumes"]:
            kind = next(k for k in volume if k != "name")
            if kind == "ephemeral":
                claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
                assert claim["accessModes"] == ["ReadWriteOnce"], ref.name
            else:
                assert kind in PROVISIONED_EVERYWHERE, (ref.name, volume)
    services = {ref.spec.service for ref in pools}
    for service in services:
        members = [p for p in pools if p.spec.service == service]
        table = build_slo_table([], [None], {}, {})
        gateway = next(
            m for m in build_gateway_children(members, table, SETTINGS) if m["kind"] == "Deployment"
        )
        names = {v["name"] for v in gateway["spec"]["template"]["spec"]["volumes"]}
        assert not names & {"model", "model-cache"}, service  # no weights in the gateway
