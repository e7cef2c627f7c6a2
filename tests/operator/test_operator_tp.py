"""Tensor-parallel pools: one pod = one instance = N ranks.

A prefill pool with ``engine.tpSize: N`` runs one ``flowprefill serve-prefill`` container
that spawns its N-1 follower ranks itself, so only the pod's plumbing changes: N GPUs, a
larger memory-backed ``/dev/shm``, threads per rank on CPU. A decode pool passes
``vllm.tensorParallelSize`` to vLLM. More ranks than GPUs is refused by the CRD's CEL rule,
by the operator's parse (objects admitted without the rule: an old CRD, the emulator),
and reported on the pool.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from flowprefill_operator.builders import PoolRef, build_pool_children
from flowprefill_operator.models import ServingPoolSpec
from flowprefill_operator.models.servingpool_rules import (
    TP_ARG_PREFIXES,
    TP_SHORT_FLAG,
    sets_tensor_parallel,
)
from flowprefill_operator.settings import OperatorSettings
from pydantic import ValidationError

from flowprefill.contracts import EngineConfig
from tests.operator.cluster import Cluster, create, pool
from tests.operator.conftest import load_docs
from tests.operator.crdcheck import validate_cr
from tests.operator.harness import wait_for

SETTINGS = OperatorSettings()
PREFILL_COMMAND = [
    "flowprefill", "serve-prefill", "--config", "/etc/flowprefill/engine.json", "--port", "8100",
    "--drain-timeout", "60",
]  # fmt: skip


def _spec(role: str = "prefill", **spec: Any) -> dict[str, Any]:
    return {"service": "llama3-70b", "role": role, "model": {"path": "/models/m"}, **spec}


def _children(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    parsed = ServingPoolSpec.model_validate(spec)
    children = build_pool_children(PoolRef("p", "ns", "uid", parsed), SETTINGS)
    for m in children:
        for version in ("1.33", "1.37"):
            kubernetes_validate.validate(m, version, strict=True)
    return {m["kind"]: m for m in children}


def _pod(children: dict[str, dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = children["Deployment"]["spec"]["template"]["spec"]
    return pod


def _shm(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["containers"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    volume: dict[str, Any] = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]
    return volume


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}


TP4 = _spec(
    engine={"tpSize": 4}, resources={"gpusPerPod": 4, "cpu": "32", "memory": "256Gi"}
)  # fmt: skip


def test_a_tp4_prefill_pool_is_one_container_with_four_gpus_and_room_in_dev_shm() -> None:
    children = _children(TP4)  # validated against the Kubernetes 1.33 and 1.37 schemas
    pod = _pod(children)
    (container,) = pod["containers"]  # the engine spawns its follower ranks itself
    gpus = {"nvidia.com/gpu": "4", "cpu": "32", "memory": "256Gi"}
    assert container["resources"] == {"requests": gpus, "limits": gpus}
    assert container["command"] == PREFILL_COMMAND  # the same command as one rank
    assert _shm(pod) == {"medium": "Memory", "sizeLimit": "4Gi"}  # 1Gi per rank
    # The same environment as a one-rank pool: rank r takes cuda:r of the pod's GPUs.
    one_rank = _pod(_children(_spec(resources={"gpusPerPod": 1})))
    assert _env(pod) == _env(one_rank)
    assert "CUDA_VISIBLE_DEVICES" not in _env(pod)
    engine = EngineConfig.model_validate_json(children["ConfigMap"]["data"]["engine.json"])
    assert (engine.tp_size, engine.device, engine.num_threads) == (4, "cuda", None)


def test_one_rank_pods_keep_their_dev_shm_and_a_set_size_wins() -> None:
    assert _shm(_pod(_children(_spec()))) == {"medium": "Memory"}  # unchanged: no roll
    sized = _spec(engine={"tpSize": 2}, resources={"gpusPerPod": 2, "shmSize": "16Gi"})
    assert _shm(_pod(_children(sized)))["sizeLimit"] == "16Gi"


@pytest.mark.parametrize(("cpu", "threads"), [("8", 4), ("3", 1), ("500m", 1), (None, None)])
def test_a_cpu_pool_runs_its_ranks_on_the_pods_cores(cpu: str | None, threads: int | None) -> None:
    """tpSize on device cpu: N processes in one pod sharing its CPU limit (what
    ``flowprefill up --tp N`` runs locally); no GPU is asked for."""
    resources: dict[str, Any] = {"gpusPerPod": 0} | ({"cpu": cpu} if cpu else {})
    children = _children(_spec(engine={"tpSize": 2, "device": "cpu"}, resources=resources))
    pod = _pod(children)
    assert "nvidia.com/gpu" not in pod["containers"][0].get("resources", {}).get("limits", {})
    assert _shm(pod)["sizeLimit"] == "2Gi"
    engine = json.loads(children["ConfigMap"]["data"]["engine.json"])
    assert (engine["tp_size"], engine["device"], engine["num_threads"]) == (2, "cpu", threads)


def test_a_tp4_decode_pool_passes_the_degree_to_vllm() -> None:
    spec = _spec(
        "decode",
        vllm={"tensorParallelSize": 4},
        vllmArgs=["--max-model-len=8192"],
        resources={"gpusPerPod": 4},
    )
    pod = _pod(_children(spec))
    command = pod["containers"][0]["command"]
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    assert command[-1] == "--max-model-len=8192"  # the user's arguments come last
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert _shm(pod)["sizeLimit"] == "4Gi"
    one_rank = _pod(_children(_spec("decode")))["containers"][0]["command"]
    assert not any(sets_tensor_parallel(a) for a in one_rank)  # vLLM's default, no flag


def test_vllm_reads_the_degree_and_every_spelling_the_crd_refuses() -> None:
    """The decode command parses with vLLM's own parser, and each spelling of the flag that
    ``vllmArgs`` may not carry is one vLLM would act on."""
    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = cli_args.make_arg_parser(FlexibleArgumentParser())
    spec = _spec("decode", vllm={"tensorParallelSize": 4}, resources={"gpusPerPod": 4})
    command = _pod(_children(spec))["containers"][0]["command"]
    assert parser.parse_args(command[3:]).tensor_parallel_size == 4
    spellings = [[TP_SHORT_FLAG, "2"]] + [[f"{p}=2" if "=" not in p else f"{p}2"]
                                         for p in TP_ARG_PREFIXES]  # fmt: skip
    for extra in spellings:
        assert parser.parse_args(["--model", "/m", *extra]).tensor_parallel_size == 2, extra
        assert sets_tensor_parallel(extra[0]), extra


def test_the_tp_example_renders_four_ranks_per_pod_in_both_roles(repo_root: Path) -> None:
    pools = [d for d in load_docs(repo_root / "examples" / "llama3-70b-tp.yaml")
             if d["kind"] == "ServingPool"]  # fmt: skip
    assert {p["spec"]["role"] for p in pools} == {"prefill", "decode"}
    for doc in pools:
        pod = _pod(_children(doc["spec"]))
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert _shm(pod)["sizeLimit"] == "4Gi"


def test_more_ranks_than_gpus_is_refused_by_cel_and_by_the_operator(crd_schemas: Any) -> None:
    for spec, fields in (
        (_spec(engine={"tpSize": 4}, resources={"gpusPerPod": 2}), "engine.tpSize"),
        (
            _spec("decode", vllm={"tensorParallelSize": 4}, resources={"gpusPerPod": 2}),
            "vllm.tensorParallelSize",
        ),
    ):
        obj = {"apiVersion": "flowprefill.io/v1alpha1", "kind": "ServingPool",
               "metadata": {"name": "p", "namespace": "ns"}, "spec": spec}  # fmt: skip
        (error,) = validate_cr(obj, crd_schemas)
        assert f"{fields} must not exceed resources.gpusPerPod" in error
        with pytest.raises(ValidationError, match=rf"{fields} must not exceed resources\."):
            ServingPoolSpec.model_validate(spec)


def test_tp_pool_with_too_few_gpus_is_reported_and_makes_no_pods(cluster: Cluster) -> None:
    ns = "e2e-tp"
    spec: dict[str, Any] = {"engine": {"tpSize": 4}, "resources": {"gpusPerPod": 2}}
    create(cluster, pool("tp", "m", **spec), ns)  # the emulator runs no CEL: the operator
    wait_for(
        lambda: cluster.condition(ns, "tp", "Degraded") == ("True", "InvalidSpec"),
        what="Degraded/InvalidSpec",
    )
    status = cluster.get("ServingPool", ns, "tp")["status"]
    assert status["phase"] == "Invalid"
    message = next(c for c in status["conditions"] if c["type"] == "Degraded")["message"]
    assert "engine.tpSize must not exceed resources.gpusPerPod" in message
    assert "(engine.tpSize=4, resources.gpusPerPod=2)" in message
    wait_for(lambda: "InvalidSpec" in cluster.event_reasons(ns, "tp"), what="Warning event")
    assert cluster.kube.get("Deployment", ns, "tp") is None
    assert cluster.kube.get("ConfigMap", ns, "tp-engine") is None
    # Four GPUs per pod: the pool is served by one pod with four ranks.
    cluster.kube.patch("ServingPool", ns, "tp", {"spec": {"resources": {"gpusPerPod": 4}}})
    wait_for(lambda: cluster.kube.get("Deployment", ns, "tp") is not None, what="Deployment")
    dep = cluster.get("Deployment", ns, "tp")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    engine = json.loads(cluster.get("ConfigMap", ns, "tp-engine")["data"]["engine.json"])
    assert engine["tp_size"] == 4
    wait_for(
        lambda: cluster.condition(ns, "tp", "Degraded")[0] == "False", what="no longer Degraded"
    )
