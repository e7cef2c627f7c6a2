"""``role: colocated`` ServingPools: the rendered pod (one container, one GPU, both
processes under the in-pod launcher, the memory split, NIXL inside the pod), the CRD's
rules for it, the gateway's lists, and the pool end to end against the emulator (children,
/scale, status, the gateway's config). The launcher itself: test_operator_colocated_launcher.py."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from flowprefill_operator.builders import PoolRef, build_gateway_children, build_pool_children
from flowprefill_operator.builders.gateway import build_gateway_config, tokenizer_pool
from flowprefill_operator.builders.rollout import GRACE_MARGIN_S, PRESTOP_SLEEP_S
from flowprefill_operator.colocated import LaunchSpec
from flowprefill_operator.controllers.kvcheck import NIXL_TP_REFUSED, nixl_problems
from flowprefill_operator.models import ServingPoolSpec
from flowprefill_operator.models.colocated import MEMORY_SPLIT_OVER
from flowprefill_operator.models.servingpool_rules import (
    COLOCATED_DEVICE,
    COLOCATED_MEMORY_ARG,
    COLOCATED_ONLY,
)
from flowprefill_operator.settings import OperatorSettings
from pydantic import ValidationError

from flowprefill.contracts import SLOTable
from flowprefill.contracts.deployment import COLOCATED_HEALTH_PORT as HEALTH_PORT
from flowprefill.contracts.deployment import VLLM_IDLE_SPIN_ENV
from tests.operator.cluster import GROUP, Cluster, create, pool, slo
from tests.operator.crdcheck import validate_cr
from tests.operator.harness import wait_for

SETTINGS = OperatorSettings()
SPEC: dict[str, Any] = {
    "service": "m",
    "role": "colocated",
    "model": {"path": "/models/m"},
    "engine": {"chunkSize": 2048},
    "vllm": {"tensorParallelSize": 1},
    "vllmArgs": ["--max-model-len=8192"],
    "colocated": {"decodeMemoryFraction": 0.5, "prefillMemoryFraction": 0.4},
    "resources": {"gpusPerPod": 1, "cpu": "8", "memory": "64Gi"},
}


def colocated(**override: Any) -> PoolRef:
    return PoolRef("m-colo", "ns", "uid-c", ServingPoolSpec.model_validate(SPEC | override))


def parts(ref: PoolRef) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(engine ConfigMap, Deployment, Service) of a colocated pool."""
    cm, dep, svc = build_pool_children(ref, SETTINGS)
    assert (cm["kind"], dep["kind"], svc["kind"]) == ("ConfigMap", "Deployment", "Service")
    return cm, dep, svc


def launch_of(container: dict[str, Any]) -> LaunchSpec:
    assert container["command"][:4] == ["python", "-m", "flowprefill_operator.colocated", "run"]
    return LaunchSpec.parse(container["command"][4])


def env_names(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# --- rendering ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.33", "1.37"])
def test_colocated_children_validate_strictly(version: str) -> None:
    ref = colocated()
    table = SLOTable(classes=[], default_class=None)
    for m in [*build_pool_children(ref, SETTINGS), *build_gateway_children([ref], table, SETTINGS)]:
        kubernetes_validate.validate(m, version, strict=True)


def test_one_container_one_gpu_both_processes_and_the_memory_split() -> None:
    cm, dep, _ = parts(colocated())
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "colocated"
    assert container["image"] == SETTINGS.decode_image  # vLLM + FlowPrefill
    gpu = {"nvidia.com/gpu": "1", "cpu": "8", "memory": "64Gi"}
    assert container["resources"] == {"requests": gpu, "limits": gpu}
    launch = launch_of(container)
    prefill, decode = launch.prefill, launch.decode
    assert prefill.argv[:2] == ["flowprefill", "serve-prefill"]
    assert "--drain-timeout" in prefill.argv
    assert prefill.memory_fraction == 0.4 and decode.memory_fraction is None
    assert decode.argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    args = decode.argv
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.5"
    assert args[args.index("--shutdown-timeout") + 1] == "300"
    assert "--max-model-len=8192" in args
    assert (prefill.port, decode.port, launch.health_port) == (8100, 8200, HEALTH_PORT)
    # Prefill names its pod's own decode, by the pod's IP (the gateway reaches it there; the
    # kubelet expands $(POD_IP) in the command, which the container's env must define).
    argv = prefill.argv
    assert argv[argv.index("--colocated-decode-url") + 1] == "http://$(POD_IP):8200"
    assert env_names(container)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # The engine's config is mounted and hashed as in a prefill pool.
    engine = json.loads(cm["data"]["engine.json"])
    assert (engine["chunk_size"], engine["device"]) == (2048, "cuda")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["engine"] == "/etc/flowprefill/engine.json"
    # Probes ask the launcher, which answers for both; startup covers both loads in turn.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 900 + 1800
    # Both drain after one SIGTERM; the pod waits for the slower (decode's 300 s).
    assert pod["terminationGracePeriodSeconds"] == PRESTOP_SLEEP_S + 300 + GRACE_MARGIN_S
    # Rollouts as for a GPU pool (no surge beyond its GPUs); the deadline covers both loads.
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert dep["spec"]["progressDeadlineSeconds"] == 900 + 1800 + 600


def test_nixl_inside_the_pod() -> None:
    cm, dep, svc = parts(colocated())
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    launch = launch_of(container)
    engine = json.loads(cm["data"]["engine.json"])
    assert engine["kv"]["transport"] == "nixl"
    assert engine["kv"]["nixl"]["side_channel_port"] == 5600
    assert engine["kv"]["nixl"]["served_model"] == "/models/m"
    block = engine["kv"]["nixl"]["block_size"]
    args = launch.decode.argv
    assert json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector"] == (
        "NixlConnector"
    )
    assert args[args.index("--block-size") + 1] == str(block)
    assert args[args.index("--model") + 1] == "/models/m"  # the handshake hashes it
    # Both advertise the pod IP; decode's side-channel port reaches decode alone.
    assert env_names(container)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    assert launch.decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in launch.prefill.env
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env_names(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8100, "decode": 8200, "nixl": 5600, "nixl-decode": 5700,
                     "health": HEALTH_PORT}  # fmt: skip
    service_ports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
    assert service_ports == {"http": (8100, "http"), "decode": (8200, "decode")}


def test_http_transport_advertises_the_pod_ip_through_the_launch_spec() -> None:
    ref = colocated(kvHandoff={"transport": "http"})
    _, dep, _ = parts(ref)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    launch = launch_of(container)
    assert launch.prefill.env["FLOWPREFILL_KV_ADVERTISE_URL"] == "http://$(POD_IP):8300"
    # The kubelet expands $(POD_IP) in the command only when the container defines it.
    assert env_names(container)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {p["name"] for p in container["ports"]} >= {"kv", "http", "decode"}
    # Prefill's hand-offs and decode's pulled copies in directories of their own (the
    # same file names), each an emptyDir of the hand-off size; the pod requests both.
    args = launch.decode.argv
    cache = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert cache["cache_dir"] == mounts["kv-pulled"] == mounts["kv"] + "-pulled"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    size = volumes["kv"]["emptyDir"]["sizeLimit"]
    assert volumes["kv-pulled"]["emptyDir"]["sizeLimit"] == size
    assert size.endswith("Mi")
    assert container["resources"]["requests"]["ephemeral-storage"] == f"{2 * int(size[:-2])}Mi"
    kubernetes_validate.validate(dep, "1.33", strict=True)


def test_cpu_colocated_pool_has_no_gpu_and_no_memory_split() -> None:
    ref = colocated(
        engine={"device": "cpu", "dtype": "float32"},
        resources={"gpusPerPod": 0, "cpu": "4"},
        colocated=None,
    )
    assert not ref.spec.on_gpu and ref.spec.kv is None  # as any CPU pool: no hand-off unset
    _, dep, _ = parts(ref)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    launch = launch_of(container)
    assert launch.prefill.memory_fraction is None
    assert "--gpu-memory-utilization" not in launch.decode.argv
    # vLLM's idle busy-wait capped on a CPU shared with prefill, as `flowprefill up` does.
    assert VLLM_IDLE_SPIN_ENV in launch.decode.env
    assert VLLM_IDLE_SPIN_ENV not in launch.prefill.env


def test_the_escape_hatch_applies_to_the_colocated_pod() -> None:
    ref = colocated(
        pod={
            "labels": {"team": "a"},
            "nodeSelector": {"gpu": "h100"},
            "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
            "serviceAccountName": "serving",
        }
    )
    _, dep, _ = parts(ref)
    template = dep["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "a"
    assert template["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert template["spec"]["serviceAccountName"] == "serving"
    (container,) = template["spec"]["containers"]
    # Container env: the launcher passes its environment to both processes.
    assert env_names(container)["NCCL_DEBUG"] == "INFO"
    kubernetes_validate.validate(dep, "1.33", strict=True)


def test_gateway_lists_a_colocated_pool_as_prefill_and_as_decode() -> None:
    colo = colocated()
    decode = PoolRef(
        "m-decode", "ns", "uid-d", ServingPoolSpec.model_validate(
            {"service": "m", "role": "decode", "model": {"path": "/models/m"}}
        ),
    )  # fmt: skip
    config = build_gateway_config([decode, colo], SETTINGS)
    host = "m-colo.ns.svc.cluster.local"
    assert [(e.pool, e.url) for e in config.prefill] == [("m-colo", f"http://{host}:8100")]
    assert [(e.pool, e.url) for e in config.decode] == [
        ("m-colo", f"http://{host}:8200"),
        ("m-decode", "http://m-decode.ns.svc.cluster.local:8200"),
    ]
    assert tokenizer_pool([decode, colo]).name == "m-colo"  # it runs the engine


def test_nixl_checks_pair_a_colocated_pool_with_itself_and_its_peers() -> None:
    # vLLM's consumer reads TP 1 or prefill's TP: 4 -> 2 cannot hand off, even in one pod.
    ref = colocated(
        engine={"tpSize": 4}, vllm={"tensorParallelSize": 2}, resources={"gpusPerPod": 4}
    )
    (problem,) = nixl_problems(ref, [ref])
    assert problem.reason == NIXL_TP_REFUSED and problem.blocks_pods
    assert "'m-colo'" in problem.message
    assert nixl_problems(colocated(), [colocated()]) == []
    # A prefill pool of the service hands off to the colocated pool's decode too.
    prefill = PoolRef(
        "m-prefill", "ns", "uid-p", ServingPoolSpec.model_validate(
            {"service": "m", "role": "prefill", "model": {"path": "/models/other"}}
        ),
    )  # fmt: skip
    (mismatch,) = nixl_problems(colocated(), [colocated(), prefill])
    assert "prefill pool 'm-prefill' to decode pool 'm-colo'" in mismatch.message


# --- the CRD's rules and the operator's mirror of them -----------------------------------


def _cr(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "m-colo", "namespace": "ns"},
        "spec": {"service": "m", "role": "colocated", "model": {"path": "/models/m"}, **spec},
    }


GOOD = [
    {},
    {k: v for k, v in SPEC.items() if k not in ("service", "role", "model")},
    {"engine": {"device": "cpu"}, "resources": {"gpusPerPod": 0}},
    {"engine": {"tpSize": 2}, "vllm": {"tensorParallelSize": 2}, "resources": {"gpusPerPod": 2}},
    {"colocated": {"decodeMemoryFraction": 0.5, "prefillMemoryFraction": 0.45}},
]


@pytest.mark.parametrize("spec", GOOD, ids=str)
def test_colocated_pools_admitted(spec: dict[str, Any], crd_schemas: Any) -> None:
    obj = _cr(**spec)
    assert validate_cr(obj, crd_schemas) == []
    ServingPoolSpec.model_validate(obj["spec"])


BAD = [
    ({"role": "prefill", "colocated": {}}, COLOCATED_ONLY),
    ({"role": "decode", "colocated": {}}, COLOCATED_ONLY),
    ({"resources": {"gpusPerPod": 0}}, COLOCATED_DEVICE),  # an unset engine runs cuda
    ({"engine": {"device": "cpu"}}, COLOCATED_DEVICE),  # a GPU requested, the engine on CPU
    ({"vllmArgs": ["--gpu-memory-utilization=0.9"]}, COLOCATED_MEMORY_ARG),
    ({"vllmArgs": ["--gpu-memory-utilization", "0.9"]}, COLOCATED_MEMORY_ARG),
    ({"colocated": {"decodeMemoryFraction": 0.6, "prefillMemoryFraction": 0.4}},
     MEMORY_SPLIT_OVER),
    ({"colocated": {"decodeMemoryFraction": 1.0}}, "decodeMemoryFraction"),
    ({"colocated": {"prefillMemoryFraction": 0}}, "prefillMemoryFraction"),
    ({"engine": {"tpSize": 2}}, "engine.tpSize must not exceed"),
    ({"vllm": {"tensorParallelSize": 2}}, "vllm.tensorParallelSize must not exceed"),
    ({"role": "decode", "engine": {}}, "engine applies to role=prefill or colocated"),
    ({"role": "prefill", "vllm": {}}, "vllm applies to role=decode or colocated"),
    ({"role": "prefill", "vllmArgs": ["--x"]}, "vllmArgs applies to role=decode or colocated"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_colocated_pools_refused_by_cel_and_model(
    spec: dict[str, Any], message: str, crd_schemas: Any
) -> None:
    obj = _cr(**spec)
    errors = validate_cr(obj, crd_schemas)
    assert any(message in e for e in errors), errors
    with pytest.raises(ValidationError):
        ServingPoolSpec.model_validate(obj["spec"])


def test_role_stays_immutable(crd_schemas: Any) -> None:
    old, new = _cr(), _cr()
    old["spec"]["role"] = "prefill"
    assert any("role is immutable" in e for e in validate_cr(new, crd_schemas, old))


# --- end to end against the emulator -----------------------------------------------------


def deployment_ready(c: Cluster, ns: str, name: str) -> None:
    """Play the Deployment controller: every replica of the current template ready."""
    dep = c.get("Deployment", ns, name)
    n = dep["spec"].get("replicas", 1)
    status = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": n,
        "readyReplicas": n,
        "updatedReplicas": n,
        "availableReplicas": n,
    }
    c.kube.patch("Deployment", ns, name, {"status": status}, sub="status")


def test_colocated_pool_scales_reports_status_and_is_in_both_gateway_lists(
    cluster: Cluster,
) -> None:
    ns = "colocated"
    create(cluster, slo("chat", 250, default=True), ns)
    create(cluster, pool("m-colo", "m", role="colocated", replicas=1,
                         colocated={"decodeMemoryFraction": 0.5}), ns)  # fmt: skip
    wait_for(lambda: cluster.names("Deployment", ns) == {"m-colo", "m-gateway"}, what="deps")
    assert cluster.names("ConfigMap", ns) >= {"m-colo-engine", "m-gateway", "m-slo-table"}
    dep = cluster.get("Deployment", ns, "m-colo")
    assert dep["metadata"]["labels"]["flowprefill.io/role"] == "colocated"
    for kind, name in (("Deployment", "m-colo"), ("Service", "m-colo")):
        kubernetes_validate.validate(cluster.get(kind, ns, name), "1.33", strict=True)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert launch_of(container).decode.argv[-2:] == ["--shutdown-timeout", "300"]
    gateway = json.loads(cluster.get("ConfigMap", ns, "m-gateway")["data"]["gateway.json"])
    assert [(e["pool"], e["port"]) for e in gateway["prefill"]] == [("m-colo", 8100)]
    assert [(e["pool"], e["port"]) for e in gateway["decode"]] == [("m-colo", 8200)]

    # kubectl scale servingpool m-colo --replicas=3: the /scale subresource.
    cluster.kube.patch("ServingPool", ns, "m-colo", {"spec": {"replicas": 3}}, sub="scale")
    wait_for(
        lambda: cluster.get("Deployment", ns, "m-colo")["spec"]["replicas"] == 3,
        what="deployment replicas 3",
    )
    deployment_ready(cluster, ns, "m-colo")
    wait_for(
        lambda: (
            (cluster.get("ServingPool", ns, "m-colo").get("status") or {}).get("readyReplicas") == 3
        ),
        what="status readyReplicas 3",
    )
    status = cluster.get("ServingPool", ns, "m-colo")["status"]
    assert (status["replicas"], status["phase"]) == (3, "Ready")
    assert status["selector"].endswith("flowprefill.io/pool=m-colo")
    scale = cluster.kube.request("GET", f"/apis/{GROUP}/namespaces/{ns}/servingpools/m-colo/scale")
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 3)

    # A decode pool joins the service: the gateway lists both decode pools.
    create(cluster, pool("m-decode", "m", role="decode"), ns)
    wait_for(
        lambda: (
            [
                e["pool"]
                for e in json.loads(
                    cluster.get("ConfigMap", ns, "m-gateway")["data"]["gateway.json"]
                )["decode"]
            ]
            == ["m-colo", "m-decode"]
        ),
        what="gateway decode list",
    )
