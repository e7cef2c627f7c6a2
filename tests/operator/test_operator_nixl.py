"""The nixl KV transport in the operator: the default on GPU pools, what it renders into
prefill's engine.json and both roles' pods, what the CRD and the model refuse, and what
the controller refuses across a service's pools (decode TP, block size, --model)."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from flowprefill_operator.builders import PoolRef, build_pool_children
from flowprefill_operator.builders.processes import pool_process
from flowprefill_operator.controllers.kvcheck import (
    MISMATCH,
    NIXL_TP_REFUSED,
    kv_mismatch,
    nixl_problems,
)
from flowprefill_operator.models import ServingPoolSpec
from flowprefill_operator.settings import OperatorSettings
from pydantic import ValidationError

from flowprefill.contracts.deployment import DECODE_PORT, DECODE_SIDE_CHANNEL_PORT
from flowprefill.contracts.engine import EngineConfig
from flowprefill.contracts.names import KVTransport
from flowprefill.contracts.nixl import (
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_PORT_ENV,
    consumer_kv_transfer_config,
)
from flowprefill.contracts.processes import Launcher, decode_process
from tests.operator.crdcheck import validate_cr
from tests.operator.test_chart_security import restricted_violations

SETTINGS = OperatorSettings()
MODEL = {"path": "/models/llama", "image": {"reference": "reg/llama@sha256:" + "0" * 64}}
POD_IP = {"fieldRef": {"fieldPath": "status.podIP"}}
RDMA_NIXL = {
    "bufferMiB": 2048,
    "blockSize": 32,
    "ucx": {
        "transports": ["rc", "cuda_copy", "cuda_ipc"],
        "netDevices": ["mlx5_0:1", "mlx5_1:1"],
        "env": {"UCX_IB_GID_INDEX": "3", "UCX_RNDV_THRESH": "8192"},
    },
    "rdma": {"resources": {"rdma/ib": "1"}},
}


def spec(role: str = "prefill", **extra: Any) -> ServingPoolSpec:
    """A GPU pool (the defaults: one GPU, a cuda engine) of service ``m``."""
    return ServingPoolSpec.model_validate({"service": "m", "role": role, "model": MODEL, **extra})


def cpu(role: str = "prefill", **extra: Any) -> ServingPoolSpec:
    """A CPU pool: prefill's engine on cpu, no GPUs."""
    engine = {"engine": {"device": "cpu"}} if role == "prefill" else {}
    return spec(role, resources={"gpusPerPod": 0}, **engine, **extra)


def children(s: ServingPoolSpec, name: str = "x") -> list[dict[str, Any]]:
    return build_pool_children(PoolRef(name, "ns", f"uid-{name}", s), SETTINGS)


def container(s: ServingPoolSpec) -> dict[str, Any]:
    (dep,) = [m for m in children(s) if m["kind"] == "Deployment"]
    kubernetes_validate.validate(dep, "1.33", strict=True)
    c: dict[str, Any] = dep["spec"]["template"]["spec"]["containers"][0]
    return c


def pod(s: ServingPoolSpec) -> dict[str, Any]:
    (dep,) = [m for m in children(s) if m["kind"] == "Deployment"]
    p: dict[str, Any] = dep["spec"]["template"]["spec"]
    return p


def engine_json(s: ServingPoolSpec) -> dict[str, Any]:
    (cm,) = [m for m in children(s) if m["kind"] == "ConfigMap"]
    config: dict[str, Any] = json.loads(cm["data"]["engine.json"])
    return config


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


# ------------------------------------------------------------------ the GPU default


def test_gpu_pools_default_to_nixl_and_cpu_pools_keep_no_handoff() -> None:
    assert spec().transport == spec("decode").transport == "nixl"
    assert spec().kv_handoff is None  # resolved, not written into the spec
    assert cpu().transport is cpu("decode").transport is None
    assert cpu().kv is None and engine_json(cpu())["kv"] is None
    # A prefill engine on cpu is a CPU pool whatever gpusPerPod says.
    assert spec(engine={"device": "cpu"}).transport is None


def test_cpu_pools_render_as_before() -> None:
    prefill, decode = container(cpu()), container(cpu("decode"))
    assert [p["name"] for p in prefill["ports"]] == [p["name"] for p in decode["ports"]] == ["http"]
    for c in (prefill, decode):
        assert SIDE_CHANNEL_HOST_ENV not in env(c)
        assert not [k for k in env(c) if k.startswith("UCX_")]
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    config = json.loads(arg(decode["command"], "--kv-transfer-config"))
    assert config["kv_connector"] == "FlowPrefillConnector"
    assert "--block-size" not in decode["command"]


@pytest.mark.parametrize(
    ("handoff", "transport"),
    [
        ({"claimName": "kv"}, "sharedDir"),  # manifests from before nixl keep their meaning
        ({"transport": "sharedDir", "claimName": "kv"}, "sharedDir"),
        ({"transport": "http"}, "http"),
        ({}, "nixl"),
        ({"nixl": {"bufferMiB": 64}}, "nixl"),
    ],
)
def test_the_transport_in_effect_on_a_gpu_pool(handoff: dict[str, Any], transport: str) -> None:
    for role in ("prefill", "decode"):
        assert spec(role, kvHandoff=handoff).transport == transport


def test_cpu_pools_take_nixl_when_asked() -> None:
    assert cpu(kvHandoff={"transport": "nixl"}).transport == "nixl"
    assert cpu(kvHandoff={"nixl": {}}).transport == "nixl"
    decode = container(cpu("decode", kvHandoff={"transport": "nixl"}))
    config = json.loads(arg(decode["command"], "--kv-transfer-config"))
    assert config == consumer_kv_transfer_config(device="cpu")
    # 128 on CPU, in both roles (vLLM's CPU backend wants multiples of 32).
    nixl = engine_json(cpu(kvHandoff={"transport": "nixl"}))["kv"]["nixl"]
    assert nixl["block_size"] == int(arg(decode["command"], "--block-size")) == 128


# ------------------------------------------------------------------ prefill


def test_prefill_with_nixl_is_a_producer_at_its_pod_ip() -> None:
    c = container(spec())
    kv = engine_json(spec())["kv"]
    assert kv["transport"] == "nixl" and kv["dir"] is None
    assert kv["nixl"]["side_channel_port"] == 5600
    assert kv["nixl"]["advertise_host"] is None  # read from the env below
    assert kv["nixl"]["buffer_mb"] == 512.0
    EngineConfig.model_validate(engine_json(spec()))  # what serve-prefill reads
    assert env(c)[SIDE_CHANNEL_HOST_ENV] == POD_IP
    assert {"name": "nixl", "containerPort": 5600, "protocol": "TCP"} in c["ports"]
    assert "--kv-port" not in c["command"]  # no http listener for hand-offs
    assert "kv" not in {v["name"] for v in pod(spec())["volumes"]}  # KV stays in memory
    assert not [k for k in env(c) if k.startswith("FLOWPREFILL_KV")]


def test_served_model_is_decodes_model_argument_and_block_sizes_agree() -> None:
    for nixl in (None, {"blockSize": 64}):
        handoff: dict[str, Any] = {"kvHandoff": {"nixl": nixl}} if nixl else {}
        prefill = engine_json(spec(**handoff))["kv"]["nixl"]
        command = container(spec("decode", **handoff))["command"]
        assert prefill["served_model"] == arg(command, "--model") == "/models/llama"
        assert prefill["block_size"] == int(arg(command, "--block-size"))
    assert int(arg(container(spec("decode"))["command"], "--block-size")) == 16  # vLLM's GPU


# ------------------------------------------------------------------ decode


def test_decode_with_nixl_is_stock_vllm_as_the_contracts_render_it() -> None:
    s = spec("decode", vllmArgs=["--max-model-len=8192"])
    c = container(s)
    expected = decode_process(
        Launcher.image(),
        model_path="/models/llama",
        port=DECODE_PORT,
        kv_transport=KVTransport.NIXL,
        extra_args=["--block-size", "16", "--shutdown-timeout", "300", "--max-model-len=8192"],
        side_channel_port=DECODE_SIDE_CHANNEL_PORT,
    )
    assert c["command"] == expected.argv == pool_process(s).argv
    config = json.loads(arg(c["command"], "--kv-transfer-config"))
    assert config == consumer_kv_transfer_config(device="cuda")
    assert env(c)[SIDE_CHANNEL_PORT_ENV] == str(DECODE_SIDE_CHANNEL_PORT)
    assert env(c)[SIDE_CHANNEL_HOST_ENV] == POD_IP
    # Nothing of FlowPrefill's in the process: no connector module, no FLOWPREFILL_* env
    # (the offline Hub variables are the pod's, not the connector's), no KV volume.
    assert "flowprefill" not in json.dumps(config)
    assert not [k for k in env(c) if k.startswith("FLOWPREFILL_")]
    assert "kv" not in {v["name"] for v in pod(s)["volumes"]}


def test_decode_can_run_the_stock_vllm_image() -> None:
    c = container(spec("decode", image="vllm/vllm-openai:v0.32.0"))
    assert c["image"] == "vllm/vllm-openai:v0.32.0"
    assert c["command"][:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]


# ------------------------------------------------------------------ UCX, RDMA, IPC_LOCK


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_rdma_ucx_and_ipc_lock_reach_both_roles(role: str) -> None:
    s = spec(role, kvHandoff={"nixl": RDMA_NIXL}, resources={"gpusPerPod": 1, "memory": "64Gi"})
    c = container(s)
    for side in ("requests", "limits"):
        assert c["resources"][side] == {"nvidia.com/gpu": "1", "memory": "64Gi", "rdma/ib": "1"}
    variables = env(c)
    assert variables["UCX_TLS"] == "rc,cuda_copy,cuda_ipc"
    assert variables["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    assert variables["UCX_IB_GID_INDEX"] == "3" and variables["UCX_RNDV_THRESH"] == "8192"
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize(
    ("nixl", "added"),
    [
        ({}, False),  # no RDMA devices: UCX over TCP needs no locked memory
        ({"rdma": {"resources": {"rdma/ib": "1"}}}, True),
        ({"rdma": {"resources": {"rdma/ib": "1"}}, "ipcLock": False}, False),
        ({"ipcLock": True}, True),
    ],
)
def test_ipc_lock_follows_rdma_unless_told(nixl: dict[str, Any], added: bool) -> None:
    caps = container(spec(kvHandoff={"nixl": nixl}))["securityContext"]["capabilities"]
    assert ("IPC_LOCK" in caps.get("add", [])) is added
    assert caps["drop"] == ["ALL"]


def test_ipc_lock_is_the_one_thing_restricted_refuses() -> None:
    """The default nixl pod passes the Pod Security Standard "restricted"; IPC_LOCK (RDMA
    memory registration) does not, and nothing else of nixl's breaks it (the documented
    exclusion: such pools need a namespace at "baseline" or an SCC that allows it). The
    model comes from a claim here (the checker predates image volumes)."""
    claim: dict[str, Any] = {"model": {"uri": "pvc://weights"}}
    assert restricted_violations(pod(spec(**claim))) == []
    assert restricted_violations(pod(spec("decode", **claim))) == []
    rdma = pod(spec(kvHandoff={"nixl": RDMA_NIXL}, **claim))
    assert restricted_violations(rdma) == ["prefill: capabilities add"]


def test_the_security_overlay_keeps_ipc_lock() -> None:
    overlay = {"containerSecurityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}}}
    s = spec(kvHandoff={"nixl": RDMA_NIXL}, pod=overlay)
    caps = container(s)["securityContext"]["capabilities"]
    assert caps == {"drop": ["ALL"], "add": ["IPC_LOCK", "NET_BIND_SERVICE"]}
    # Without nixl's capability the overlay's add is the pod's add, as before.
    plain = container(spec(kvHandoff={"transport": "http"}, pod=overlay))
    assert plain["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["NET_BIND_SERVICE"],
    }


def test_http_and_shared_dir_have_none_of_it() -> None:
    for handoff in ({"transport": "http"}, {"claimName": "kv"}):
        for role in ("prefill", "decode"):
            c = container(spec(role, kvHandoff=handoff))
            assert SIDE_CHANNEL_HOST_ENV not in env(c) and SIDE_CHANNEL_PORT_ENV not in env(c)
            assert "nixl" not in {p["name"] for p in c["ports"]}
            assert "--block-size" not in c["command"]
            assert "add" not in c["securityContext"]["capabilities"]
    decode = container(spec("decode", kvHandoff={"transport": "http"}))
    config = json.loads(arg(decode["command"], "--kv-transfer-config"))
    assert config["kv_connector"] == "FlowPrefillConnector"


# ------------------------------------------------------------------ CRD and model rules


def _cr(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "m-x", "namespace": "ns"},
        "spec": {"service": "m", "role": "prefill", "model": {"path": "/models/m"}, **s},
    }


CPU_DECODE = {"role": "decode", "resources": {"gpusPerPod": 0}}
BAD = [
    ({"kvHandoff": {"nixl": {"ucx": {"env": {"NCCL_DEBUG": "INFO"}}}}}, "must start with UCX_"),
    ({"kvHandoff": {"nixl": {"ucx": {"env": {"UCX_TLS": "tcp"}}}}}, "with ucx.transports"),
    ({"kvHandoff": {"nixl": {"ucx": {"transports": ["rc,tcp"]}}}}, "transports"),
    ({"kvHandoff": {"transport": "http", "nixl": {}}}, "applies to transport nixl"),
    ({"kvHandoff": {"claimName": "kv", "nixl": {"ipcLock": True}}}, "applies to transport nixl"),
    ({"kvHandoff": {"transport": "nixl", "claimName": "kv"}}, "not used with http or nixl"),
    ({"kvHandoff": {"nixl": {"rdma": {"resources": {"rdma/ib": "one"}}}}}, "resources"),
    ({"kvHandoff": {"nixl": {"bufferMiB": 0}}}, "bufferMiB"),
    ({"kvHandoff": {"nixl": {"rdma": {"resources": {"memory": "1Gi"}}}}}, "extended resources"),
    (
        {"kvHandoff": {"nixl": {"rdma": {"resources": {"nvidia.com/gpu": "1"}}}}},
        "must not name resources.gpuResourceName",
    ),
    ({**CPU_DECODE, "kvHandoff": {"nixl": {"blockSize": 48}}}, "multiple of 32"),
    ({"role": "decode", "vllmArgs": ["--block-size", "32"]}, "not --block-size in vllmArgs"),
    ({"role": "decode", "vllmArgs": ["--block-size=32"]}, "not --block-size in vllmArgs"),
    ({**CPU_DECODE, "kvHandoff": {}}, "claimName is required with transport sharedDir"),
]


@pytest.mark.parametrize(("override", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_nixl_settings_are_refused_by_the_crd_and_the_model(
    override: dict[str, Any], message: str, crd_schemas: Any
) -> None:
    obj = _cr(override)
    errors = validate_cr(obj, crd_schemas)
    assert any(message in e for e in errors), errors
    with pytest.raises(ValidationError):
        ServingPoolSpec.model_validate(obj["spec"])


GOOD = [
    {"kvHandoff": {"nixl": RDMA_NIXL}},
    {"kvHandoff": {"transport": "nixl", "nixl": {"ipcLock": True}}},
    {**CPU_DECODE, "kvHandoff": {"nixl": {"blockSize": 64}}},
    {**CPU_DECODE, "vllmArgs": ["--block-size", "32"]},  # no hand-off, no nixl: vLLM's own
    {"role": "decode", "kvHandoff": {"transport": "http"}, "vllmArgs": ["--block-size=32"]},
    {"kvHandoff": {"claimName": "kv"}},
    {"kvHandoff": {}},
]


@pytest.mark.parametrize("override", GOOD)
def test_good_nixl_settings_pass_both(override: dict[str, Any], crd_schemas: Any) -> None:
    obj = _cr(override)
    assert validate_cr(obj, crd_schemas) == []
    ServingPoolSpec.model_validate(obj["spec"])


# ------------------------------------------------------------------ across the pools


def refs(prefill: ServingPoolSpec, decode: ServingPoolSpec) -> tuple[PoolRef, PoolRef]:
    return PoolRef("m-prefill", "ns", "u1", prefill), PoolRef("m-decode", "ns", "u2", decode)


TP: dict[str, Any] = {"engine": {"tpSize": 4}, "resources": {"gpusPerPod": 4}}


@pytest.mark.parametrize("decode_tp", [1, 4])
def test_decode_tp_one_or_prefills_passes(decode_tp: int) -> None:
    d = spec("decode", vllm={"tensorParallelSize": decode_tp}, resources={"gpusPerPod": 4})
    p, d_ref = refs(spec(**TP), d)
    for pool in (p, d_ref):
        assert nixl_problems(pool, [p, d_ref]) == []


def test_a_decode_tp_vllm_cannot_pull_is_refused_before_pods_start() -> None:
    d = spec("decode", vllm={"tensorParallelSize": 2}, resources={"gpusPerPod": 2})
    p, d_ref = refs(spec(**TP), d)
    for pool in (p, d_ref):
        [problem] = nixl_problems(pool, [p, d_ref])
        assert problem.reason == NIXL_TP_REFUSED and problem.blocks_pods
        assert "vllm.tensorParallelSize=2" in problem.message
        assert "engine.tpSize=4" in problem.message
        assert "use decode TP 1 or 4" in problem.message
    # Over http the connector gathers any layout: no refusal.
    http: dict[str, Any] = {"kvHandoff": {"transport": "http"}}
    p, d_ref = refs(spec(**TP, **http), spec("decode", **http, vllm={"tensorParallelSize": 2},
                                             resources={"gpusPerPod": 2}))  # fmt: skip
    assert nixl_problems(p, [p, d_ref]) == []


def test_block_size_model_and_device_must_agree() -> None:
    p, d = refs(spec(kvHandoff={"nixl": {"blockSize": 32}}), spec("decode"))
    [problem] = nixl_problems(d, [p, d])
    assert problem.reason == MISMATCH and not problem.blocks_pods
    assert "kvHandoff.nixl.blockSize (prefill 32, decode 16)" in problem.message
    other = spec("decode", model={"path": "/models/other", "image": MODEL["image"]})
    [problem] = nixl_problems(p, list(refs(spec(), other)))
    assert "decode --model '/models/other'" in problem.message
    p, d = refs(spec(kvHandoff={"nixl": {"blockSize": 128}}), cpu("decode", kvHandoff={"nixl": {}}))
    [problem] = nixl_problems(p, [p, d])
    assert "prefill on GPUs, decode on CPU" in problem.message


def test_a_gpu_prefill_beside_a_cpu_decode_without_kvhandoff_is_a_mismatch() -> None:
    p, d = refs(spec(), cpu("decode"))
    [problem] = kv_mismatch(p, [p, d])
    assert problem.message == (
        "this pool has kvHandoff nixl (unset: the default on GPUs) but decode pool "
        "'m-decode' has no kvHandoff"
    )
    assert nixl_problems(p, [p, d]) == []  # the mismatch says it


# ------------------------------------------------------------------ chart and docs


def test_the_chart_lets_prefill_and_decode_reach_each_other_on_any_tcp_port() -> None:
    from flowprefill.contracts.deployment import PREFILL_SIDE_CHANNEL_PORT
    from tests.operator.chart import allowed
    from tests.operator.test_chart_policies import NAMESPACED, pods, policies

    a = pods("team-a")
    prefill, decode, gateway = a["prefill"][0], a["decode"][0], a["gateway"][0]
    nps = policies(*NAMESPACED)
    for port in (PREFILL_SIDE_CHANNEL_PORT, 45_678):  # the side channel, a UCX ephemeral port
        assert allowed(nps, decode, prefill, port)
        assert allowed(nps, prefill, decode, port)
        assert not allowed(nps, gateway, prefill, port)  # only the two roles gain it
        assert not allowed(nps, pods("team-b")["decode"][0], prefill, port)
    closed = policies(*NAMESPACED, "--set", "networkPolicy.kvOverNixl=false")
    assert not allowed(closed, decode, prefill, PREFILL_SIDE_CHANNEL_PORT)
    assert not allowed(closed, prefill, decode, 45_678)


def test_the_yaml_in_docs_operator_md_is_admitted(repo_root: Any, crd_schemas: Any) -> None:
    import re

    import yaml

    text = (repo_root / "docs" / "operator.md").read_text()
    section = text[text.index("### KV transport") :]
    block = re.search(r"```yaml\n(kvHandoff:.*?)```", section, re.S)
    assert block is not None
    handoff = yaml.safe_load(block.group(1))["kvHandoff"]
    for role in ("prefill", "decode"):
        obj = _cr({"role": role, "kvHandoff": handoff})
        assert validate_cr(obj, crd_schemas) == []
        assert ServingPoolSpec.model_validate(obj["spec"]).transport == "nixl"
