"""Pure builders: manifests valid for Kubernetes, command lines and files as contracted."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from flowprefill_operator.builders import (
    PoolRef,
    SLOClassView,
    build_engine_config,
    build_gateway_children,
    build_pool_children,
    build_slo_table,
    judge_classes,
    sha256_hex,
)
from flowprefill_operator.builders.common import CONFIG_HASH
from flowprefill_operator.models import LabelSelector, ServingPoolSpec, SLOClassSpec
from flowprefill_operator.settings import OperatorSettings
from pydantic import ValidationError

SETTINGS = OperatorSettings()
PREFILL = ServingPoolSpec.model_validate(
    {
        "service": "llama3-8b",
        "role": "prefill",
        "replicas": 3,
        "model": {
            "uri": "hf://meta-llama/Llama-3.1-8B-Instruct",
            "tokenSecretRef": {"name": "hf-token"},
            "cache": {"ephemeral": {"size": "40Gi", "storageClassName": "gp3"}},
        },
        "engine": {"chunkSize": 2048, "ttftProfile": {"name": "prof", "key": "a100.json"}},
        "resources": {
            "gpusPerPod": 1,
            "cpu": "8",
            "memory": "64Gi",
            "nodeSelector": {"gpu": "a100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        },
    }
)
DECODE = ServingPoolSpec.model_validate(
    {
        "service": "llama3-8b",
        "role": "decode",
        "model": {"path": "/models/llama", "image": {"reference": "reg/llama@sha256:" + "0" * 64}},
        "vllmArgs": ["--max-model-len=8192"],
    }
)
LLAMA_DIR = "/var/cache/flowprefill/models/hf/meta-llama/Llama-3.1-8B-Instruct/main"
P = PoolRef("llama3-8b-prefill", "ns", "uid-p", PREFILL)
D = PoolRef("llama3-8b-decode", "ns", "uid-d", DECODE)


def by_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def _all() -> list[dict[str, Any]]:
    classes = [SLOClassView("chat", {}, "t0", 1, SLOClassSpec(task_type="text", ttft_slo_ms=250))]
    table = build_slo_table(classes, [None], judge_classes(classes, {}), {})
    return [
        *build_pool_children(P, SETTINGS),
        *build_pool_children(D, SETTINGS),
        *build_gateway_children([P, D], table, SETTINGS),
    ]


@pytest.mark.parametrize("version", ["1.33", "1.37"])
def test_every_child_validates_strictly(version: str) -> None:
    manifests = _all()
    assert {m["kind"] for m in manifests} == {"ConfigMap", "Deployment", "Service"}
    for m in manifests:
        kubernetes_validate.validate(m, version, strict=True)


def test_a_bad_manifest_would_be_caught() -> None:
    dep = by_kind(build_pool_children(P, SETTINGS), "Deployment")[0]
    dep["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, "1.33", strict=True)


def test_prefill_command_config_and_probes() -> None:
    children = build_pool_children(P, SETTINGS)
    dep = by_kind(children, "Deployment")[0]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == [
        "flowprefill",
        "serve-prefill",
        "--config",
        "/etc/flowprefill/engine.json",
        "--port",
        "8100",
        # The drain bound the grace period is sized around (builders/rollout.py).
        "--drain-timeout",
        "60",
    ]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1", "cpu": "8", "memory": "64Gi"}
    assert dep["spec"]["replicas"] == 3
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    engine = json.loads(by_kind(children, "ConfigMap")[0]["data"]["engine.json"])
    assert engine == {
        "model_path": LLAMA_DIR,
        "granularity": "operator",
        "batch_token_budget": 4096,
        "chunk_size": 2048,
        "max_blocking_ms": None,
        "parked_memory_bytes": None,
        "policy": "s-edf",
        "predictor_path": "/etc/flowprefill/profile/a100.json",
        "tp_size": 1,
        "device": "cuda",
        "dtype": "bfloat16",
        "batching": "slo-aware",
        "kernels": None,
        "num_threads": None,
        "device_sync": "every_check",
        # No kvHandoff on a GPU pool: nixl with its defaults (test_operator_nixl.py).
        "kv": {
            "transport": "nixl",
            "dir": None,
            "advertise_url": None,
            "max_age_s": 600.0,
            "budget_mb": 8192.0,  # the contract's default KV budget
            "nixl": {
                "side_channel_port": 5600,
                "advertise_host": None,
                "served_model": LLAMA_DIR,
                "buffer_mb": 512.0,
                "block_size": 16,
                "attention_backend": None,
                "lease_s": 30.0,
                "progress_thread": None,  # NIXL's own choice per device
            },
        },
        "decode_aware": None,  # a colocated pool's option (test_operator_colocated_decode_aware)
    }
    svc = by_kind(children, "Service")[0]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_engine_json_is_what_the_engine_reads() -> None:
    config = pytest.importorskip("flowprefill.contracts")
    config.EngineConfig.model_validate(build_engine_config(PREFILL).model_dump())


def test_engine_config_change_rolls_the_pods_and_nothing_else_does() -> None:
    def digest(spec: ServingPoolSpec) -> str:
        dep = by_kind(
            build_pool_children(P.__class__(P.name, "ns", "u", spec), SETTINGS), "Deployment"
        )[0]
        return str(dep["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH])

    base = digest(PREFILL)
    assert digest(PREFILL.model_copy(update={"replicas": 7})) == base
    changed = PREFILL.model_copy(
        update={"engine": PREFILL.engine_settings.model_copy(update={"policy": "fcfs"})}
    )
    assert digest(changed) != base


def test_decode_command_and_model_image_volume() -> None:
    dep = by_kind(build_pool_children(D, SETTINGS), "Deployment")[0]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == [
        "python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/llama",
        "--port",
        "8200",
        # No kvHandoff on a GPU pool: stock vLLM pulling over nixl (test_operator_nixl.py).
        "--kv-transfer-config",
        '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cuda",'
        '"kv_load_failure_policy":"recompute"}',
        # The layout prefill writes its pages in (contracts.processes.decode_process).
        "--attention-backend",
        "FLASH_ATTN",
        "--block-size",
        "16",
        # vLLM's default (0) aborts every stream on SIGTERM: drain them instead.
        "--shutdown-timeout",
        "300",
        "--max-model-len=8192",
    ]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["image"]["reference"].startswith("reg/llama@sha256:")
    assert by_kind(build_pool_children(D, SETTINGS), "ConfigMap") == []


def _pod(spec: ServingPoolSpec) -> dict[str, Any]:
    dep = by_kind(build_pool_children(PoolRef("x", "ns", "u", spec), SETTINGS), "Deployment")[0]
    kubernetes_validate.validate(dep, "1.33", strict=True)
    pod: dict[str, Any] = dep["spec"]["template"]["spec"]
    return pod


def _kv_config(command: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(command[command.index("--kv-transfer-config") + 1])
    return config["kv_connector_extra_config"]


def test_shared_dir_kv_handoff_mounts_the_claim_in_both_roles() -> None:
    handoff = {"claimName": "kv", "mountPath": "/kv"}
    p = PREFILL.model_validate({**PREFILL.wire(), "kvHandoff": handoff})
    d = DECODE.model_validate({**DECODE.wire(), "kvHandoff": handoff})
    for spec in (p, d):
        pod = _pod(spec)
        assert {"name": "kv", "persistentVolumeClaim": {"claimName": "kv"}} in pod["volumes"]
        assert {"name": "kv", "mountPath": "/kv"} in pod["containers"][0]["volumeMounts"]
        command = pod["containers"][0]["command"]
        if spec.role == "prefill":
            kv = build_engine_config(spec).kv
            assert kv is not None and (kv.dir, kv.max_age_s) == ("/kv", 600)
            # Decode reads the volume: no KV listener, no port for it.
            assert "--kv-port" not in command
            assert [pt["name"] for pt in pod["containers"][0]["ports"]] == ["http"]
        else:
            assert _kv_config(command) == {"shared_storage_path": "/kv"}


def test_http_kv_handoff_gives_each_pod_its_own_dir_and_prefill_its_pod_ip() -> None:
    handoff = {"transport": "http", "sizeLimit": "20Gi", "maxAgeSeconds": 120}
    p = PREFILL.model_validate({**PREFILL.wire(), "kvHandoff": handoff})
    d = DECODE.model_validate({**DECODE.wire(), "kvHandoff": {"transport": "http"}})
    mount = "/var/lib/flowprefill/kv"

    prefill = _pod(p)
    container = prefill["containers"][0]
    assert {"name": "kv", "emptyDir": {"sizeLimit": "20Gi"}} in prefill["volumes"]
    assert {"name": "kv", "mountPath": mount} in container["volumeMounts"]
    # The KV settings travel in engine.json, which serve-prefill reads.
    engine = json.loads(by_kind(build_pool_children(P.__class__(P.name, "ns", "u", p), SETTINGS),
                                "ConfigMap")[0]["data"]["engine.json"])  # fmt: skip
    assert engine["kv"] == {
        "transport": "http", "dir": mount, "advertise_url": None, "max_age_s": 120.0,
        "budget_mb": 0.9 * 20 * 1024, "nixl": None,  # 90 % of sizeLimit (no budget set)
    }  # fmt: skip
    env = [e["name"] for e in container["env"]]
    # $(POD_IP) expands only from variables defined before it.
    assert env.index("POD_IP") < env.index("FLOWPREFILL_KV_ADVERTISE_URL")
    by_name = {e["name"]: e for e in container["env"]}
    assert by_name["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Decode pulls from the pod's KV port, not its API port (which the gateways reach):
    # serve-prefill listens there, the pod names it, and the hand-offs advertise it.
    assert by_name["FLOWPREFILL_KV_ADVERTISE_URL"]["value"] == "http://$(POD_IP):8300"
    command = container["command"]
    assert command[command.index("--kv-port") + 1] == "8300"
    assert container["ports"] == [
        {"name": "http", "containerPort": 8100, "protocol": "TCP"},
        {"name": "kv", "containerPort": 8300, "protocol": "TCP"},
    ]
    # The pool's Service stays the API's: decode reaches the pod by its IP, not the Service.
    (service,) = by_kind(build_pool_children(P.__class__(P.name, "ns", "u", p), SETTINGS),
                         "Service")  # fmt: skip
    assert [pt["port"] for pt in service["spec"]["ports"]] == [8100]

    decode = _pod(d)
    container = decode["containers"][0]
    assert {"name": "kv", "emptyDir": {"sizeLimit": "9012Mi"}} in decode["volumes"]  # 8Gi + 10 %
    assert _kv_config(container["command"]) == {"transport": "http", "cache_dir": mount}
    assert "POD_IP" not in {e["name"] for e in container["env"]}


def test_http_kv_handoff_matches_what_the_connector_and_server_read() -> None:
    from flowprefill.contracts.deployment import KV_ADVERTISE_URL_ENV as ADVERTISE_URL_ENV
    from flowprefill.contracts.kv import kv_transfer_config as connector_config

    d = DECODE.model_validate({**DECODE.wire(), "kvHandoff": {"transport": "http"}})
    command = _pod(d)["containers"][0]["command"]
    built = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert built == connector_config("/var/lib/flowprefill/kv", transport="http")
    # A failed load recomputes instead of failing the request (vLLM's default is "fail").
    assert built["kv_load_failure_policy"] == "recompute"
    p = PREFILL.model_validate({**PREFILL.wire(), "kvHandoff": {"transport": "http"}})
    assert ADVERTISE_URL_ENV in {e["name"] for e in _pod(p)["containers"][0]["env"]}


def test_engine_batching_reaches_engine_json() -> None:
    p = PREFILL.model_validate(
        {**PREFILL.wire(), "engine": {**PREFILL.wire()["engine"], "batching": "member-headroom"}}
    )
    assert build_engine_config(p).batching == "member-headroom"
    assert build_engine_config(PREFILL).batching == "slo-aware"


def test_engine_blocking_bound_reaches_engine_json() -> None:
    def with_engine(**engine: object) -> ServingPoolSpec:
        wire = PREFILL.wire()
        return PREFILL.model_validate({**wire, "engine": {**wire["engine"], **engine}})

    # Unset: the engine's per-device default (PREFILL runs on cuda: no splitting there).
    assert build_engine_config(PREFILL).resolved_max_blocking_ms() is None
    assert build_engine_config(with_engine(maxBlockingMs=2.5)).resolved_max_blocking_ms() == 2.5
    off = build_engine_config(with_engine(operatorSplitting=False, maxBlockingMs=2.5))
    assert off.max_blocking_ms == "off" and off.resolved_max_blocking_ms() is None
    with pytest.raises(ValidationError, match=r"maxBlockingMs|max_blocking_ms"):
        with_engine(maxBlockingMs=0)


def test_engine_parked_memory_budget_reaches_engine_json() -> None:
    def with_engine(**engine: object) -> ServingPoolSpec:
        wire = PREFILL.wire()
        return PREFILL.model_validate({**wire, "engine": {**wire["engine"], **engine}})

    assert build_engine_config(PREFILL).parked_memory_bytes is None  # unbounded
    assert build_engine_config(with_engine(parkedMemory="4Gi")).parked_memory_bytes == 4 * 2**30
    assert (
        build_engine_config(with_engine(parkedMemory="1500M")).parked_memory_bytes == 1500 * 10**6
    )
    children = build_pool_children(
        PoolRef("llama3-8b-prefill", "ns", "uid-p", with_engine(parkedMemory="2Gi")), SETTINGS
    )
    engine = json.loads(by_kind(children, "ConfigMap")[0]["data"]["engine.json"])
    assert engine["parked_memory_bytes"] == 2 * 2**30
    with pytest.raises(ValidationError, match=r"parkedMemory|parked_memory"):
        with_engine(parkedMemory="lots")


def test_children_are_owned_by_their_pool_and_gateway_by_all_pools() -> None:
    for m in build_pool_children(P, SETTINGS):
        assert m["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "flowprefill.io/v1alpha1",
                "kind": "ServingPool",
                "name": "llama3-8b-prefill",
                "uid": "uid-p",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    table = build_slo_table([], [None], {}, {})
    for m in build_gateway_children([P, D], table, SETTINGS):
        assert {o["uid"] for o in m["metadata"]["ownerReferences"]} == {"uid-p", "uid-d"}


def test_gateway_command_config_and_slo_table_mount() -> None:
    table = build_slo_table([], [None], {}, {})
    children = build_gateway_children([P, D], table, SETTINGS)
    dep = by_kind(children, "Deployment")[0]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == [
        "flowprefill",
        "serve-gateway",
        "--config",
        "/etc/flowprefill/gateway.json",
        "--slo-table",
        "/etc/flowprefill/slo/slo-table.json",
        "--port",
        "8000",
        "--drain-timeout",
        "300",
    ]
    slo_mount = next(m for m in container["volumeMounts"] if m["name"] == "slo")
    assert "subPath" not in slo_mount  # a directory mount is refreshed in place
    gw = json.loads(by_kind(children, "ConfigMap")[0]["data"]["gateway.json"])
    assert gw["model_name"] == "llama3-8b"
    host = "llama3-8b-prefill.ns.svc.cluster.local"
    assert gw["prefill"] == [
        {"pool": "llama3-8b-prefill", "host": host, "port": 8100, "url": f"http://{host}:8100"}
    ]
    assert [e["port"] for e in gw["decode"]] == [8200]
    # The gateway tokenizes with the prefill pool's model: its tokenizer files alone,
    # downloaded into the gateway's own emptyDir; no weights volume.
    assert gw["tokenizer_path"] == "/var/cache/flowprefill/tokenizer"
    pod = dep["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"]} == {"config", "slo", "tmp", "tokenizer"}
    (step,) = pod["initContainers"]
    assert step["command"] == [
        "flowprefill", "fetch-model", "hf://meta-llama/Llama-3.1-8B-Instruct",
        "--dest", "/var/cache/flowprefill/tokenizer", "--tokenizer-only",
    ]  # fmt: skip
    assert step["image"] == SETTINGS.gateway_image
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token",
            "key": "HF_TOKEN"}}} in step["env"]  # fmt: skip


def view(
    name: str, created: str = "t0", labels: dict[str, str] | None = None, **spec: Any
) -> SLOClassView:
    parsed = SLOClassSpec.model_validate({"taskType": "text", "ttftSloMs": 250, **spec})
    return SLOClassView(name, labels or {}, created, 1, parsed)


def test_slo_table_order_default_selection_and_hashes() -> None:
    classes = [
        view("file", taskType="file", ttftSloMs=6000, priority=0, labels={"tier": "bg"}),
        view(
            "chat",
            priority=30,
            default=True,
            match={"headers": [{"name": "x-slo-class", "value": "chat"}]},
        ),
        view(
            "search",
            taskType="search",
            ttftSloMs=4000,
            priority=10,
            labels={"tier": "bg"},
            match={"apiKeySecretRef": {"name": "keys"}},
        ),
    ]
    secrets = {"keys": [sha256_hex("k1")]}
    verdicts = judge_classes(classes, secrets)
    table = build_slo_table(classes, [None], verdicts, secrets)
    assert [c.name for c in table.classes] == ["chat", "search", "file"]
    assert table.default_class == "chat"
    assert table.classes[0].match.headers == {"x-slo-class": "chat"}
    assert table.classes[1].match.api_key_hashes == [sha256_hex("k1")]
    assert "k1" not in table.model_dump_json()
    only_bg = build_slo_table(
        classes, [LabelSelector(match_labels={"tier": "bg"})], verdicts, secrets
    )
    assert [c.name for c in only_bg.classes] == ["search", "file"]
    assert only_bg.default_class is None


def test_slo_table_is_what_the_gateway_reads() -> None:
    contracts = pytest.importorskip("flowprefill.contracts")
    table = build_slo_table(
        [view("chat", default=True)], [None], judge_classes([view("chat", default=True)], {}), {}
    )
    contracts.SLOTable.model_validate_json(table.model_dump_json())


def test_judging_duplicate_defaults_missing_secrets_and_invalid_specs() -> None:
    classes = [
        view("b", created="t2", default=True),
        view("a", created="t1", default=True),
        view("c", match={"apiKeySecretRef": {"name": "gone"}}),
        SLOClassView("d", {}, "t0", 1, None, "spec.ttftSloMs: missing"),
    ]
    verdicts = judge_classes(classes, {"gone": None})
    assert verdicts["a"].accepted and verdicts["a"].reason == "Accepted"
    assert (verdicts["b"].accepted, verdicts["b"].reason) == (False, "DuplicateDefault")
    assert (verdicts["c"].accepted, verdicts["c"].reason) == (False, "SecretNotFound")
    assert (verdicts["d"].accepted, verdicts["d"].reason) == (False, "InvalidSpec")
    table = build_slo_table(classes, [None], verdicts, {"gone": None})
    assert table.default_class == "a"
    assert [c.name for c in table.classes] == ["a", "b", "c"]


def test_cpu_decode_pods_cap_vllms_idle_busy_wait() -> None:
    from flowprefill.contracts.deployment import CPU_VLLM_IDLE_SPIN_S as CPU_IDLE_SPIN_S
    from flowprefill.contracts.deployment import VLLM_IDLE_SPIN_ENV as IDLE_SPIN_ENV

    cpu = DECODE.model_validate({**DECODE.wire(), "resources": {"gpusPerPod": 0}})
    env = {e["name"]: e.get("value") for e in _pod(cpu)["containers"][0]["env"]}
    assert env[IDLE_SPIN_ENV] == CPU_IDLE_SPIN_S
    for spec in (DECODE, PREFILL):  # GPU decode keeps vLLM's default; prefill has no vLLM
        assert IDLE_SPIN_ENV not in {e["name"] for e in _pod(spec)["containers"][0]["env"]}
