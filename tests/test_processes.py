"""``flowprefill up`` and the operator render the same processes from one description.

Both go through :mod:`flowprefill.contracts.processes`; this test renders each side the
way users run it (up's child processes, the operator's Deployments) and compares what
must agree: the argv after the launcher, the product's environment, the port and the
probe paths, and the engine.json each side writes. Only where things live may differ
(launcher, file paths, listen host, the address decode reaches prefill at, placement
environment such as caches), and those are normalised explicitly below.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from flowprefill.contracts import EngineConfig, SLOTable
from flowprefill.contracts.deployment import (
    DECODE_PORT,
    ENGINE_CONFIG_PATH,
    GATEWAY_CONFIG_PATH,
    GATEWAY_PORT,
    POD_IP_ENV,
    PREFILL_KV_PORT,
    PREFILL_PORT,
    SLO_DIR,
    SLO_TABLE_FILE,
)
from flowprefill.contracts.processes import Launcher
from flowprefill.stack.decode import decode_args
from flowprefill.stack.supervisor import Child
from flowprefill.stack.up import add_arguments, plan_stack

pytest.importorskip("kopf")

from flowprefill_operator.builders import build_gateway_children, build_pool_children
from flowprefill_operator.builders.common import SCRATCH_ENV, PoolRef
from flowprefill_operator.models import ServingPoolSpec
from flowprefill_operator.settings import OperatorSettings

MODEL = "/models/m"
HOST = "<host>"
KV_MOUNT = "/var/lib/flowprefill/kv"


def _up(tmp_path: Path, transport: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--kv-transport", transport, "--policy", "d_edf"])
    plan = plan_stack(args, Path(MODEL), tmp_path / "p.json", SLOTable.paper(), tmp_path)
    by_role = {c.process.role.value: c for c in plan.children}
    return {"children": by_role, "files": plan.files, "run_dir": str(tmp_path)}


def _operator(transport: str) -> dict[str, Any]:
    settings = OperatorSettings()
    kv = {"transport": "http"} if transport == "http" else {"claimName": "kv"}
    common = {"service": "m", "model": {"path": MODEL}, "kvHandoff": kv}
    prefill = ServingPoolSpec.model_validate(
        {
            **common,
            "role": "prefill",
            "engine": {"device": "cpu", "dtype": "float32", "policy": "d-edf"},
        }
    )
    decode = ServingPoolSpec.model_validate(
        {**common, "role": "decode", "resources": {"gpusPerPod": 0}}  # a CPU host, as up's
    )
    pools = [PoolRef("m-prefill", "ns", "u1", prefill), PoolRef("m-decode", "ns", "u2", decode)]
    manifests = [*build_pool_children(pools[0], settings), *build_pool_children(pools[1], settings)]
    manifests += build_gateway_children(pools, SLOTable.paper(), settings)
    containers = {}
    engine_json = None
    for m in manifests:
        if m["kind"] == "Deployment":
            c = m["spec"]["template"]["spec"]["containers"][0]
            containers[c["name"]] = c
        if m["kind"] == "ConfigMap" and "engine.json" in m["data"]:
            engine_json = m["data"]["engine.json"]
    return {"containers": containers, "engine_json": engine_json}


# Where the two differ on purpose: the listen address, and the pods' drain bounds (the
# operator's rollout: a terminating pod finishes its streams; up's children stop on Ctrl-C).
NOT_COMPARED = ("--host", "--drain-timeout", "--shutdown-timeout")


def _compared(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in NOT_COMPARED:
            skip = True
            continue
        out.append(a)
    return out


def _normalise(args: list[str], paths: dict[str, str]) -> list[str]:
    out = []
    for a in _compared(args):
        if a.startswith("{"):  # the connector config: compare as data, paths replaced
            config = json.loads(a)
            extra = config.get("kv_connector_extra_config", {})
            config["kv_connector_extra_config"] = {k: paths.get(v, v) for k, v in extra.items()}
            a = json.dumps(config, sort_keys=True)
        out.append(paths.get(a, a))
    return out


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    placement = {e["name"] for e in SCRATCH_ENV} | {POD_IP_ENV}
    return {
        e["name"]: e["value"].replace(f"$({POD_IP_ENV})", HOST)
        for e in container.get("env", [])
        if e["name"] not in placement
    }


def _child_env(child: Child) -> dict[str, str]:
    return {k: v.replace("127.0.0.1", HOST) for k, v in child.process.env.items()}


@pytest.mark.parametrize("transport", ["shared_dir", "http"])
def test_up_and_the_operator_render_the_same_processes(tmp_path: Path, transport: str) -> None:
    up = _up(tmp_path, transport)
    op = _operator(transport)
    run = up["run_dir"]
    paths = {
        f"{run}/engine-0.json": "<engine.json>",
        ENGINE_CONFIG_PATH: "<engine.json>",
        f"{run}/gateway.json": "<gateway.json>",
        GATEWAY_CONFIG_PATH: "<gateway.json>",
        f"{run}/slo-table.json": "<slo-table.json>",
        f"{SLO_DIR}/{SLO_TABLE_FILE}": "<slo-table.json>",
        f"{run}/kv": "<kv>",
        f"{run}/kv-cache-0": "<kv>",
        KV_MOUNT: "<kv>",
    }
    ports = {"prefill": PREFILL_PORT, "decode": DECODE_PORT, "gateway": GATEWAY_PORT}
    for role, port in ports.items():
        child: Child = up["children"][role]
        container = op["containers"][role]
        up_args = child.process.args
        if role == "decode":  # this machine's vLLM settings (dtype, eager, ...) come last
            tail = decode_args(Path(MODEL))
            assert list(up_args[-len(tail) :]) == tail
            up_args = up_args[: -len(tail)]
        image = Launcher.image()
        launcher = len(image.vllm if role == "decode" else image.flowprefill)
        assert _normalise(list(up_args), paths) == _normalise(
            container["command"][launcher:], paths
        ), role
        assert _child_env(child) == _container_env(container), role
        assert child.process.port == port == container["ports"][0]["containerPort"], role
        assert child.process.ready_path == container["readinessProbe"]["httpGet"]["path"], role
        assert child.process.health_path == container["livenessProbe"]["httpGet"]["path"], role

    # engine.json: the same schema and the same scheduling and hand-off settings.
    local = EngineConfig.model_validate_json(up["files"]["engine-0.json"])
    remote = EngineConfig.model_validate_json(op["engine_json"])
    assert set(json.loads(up["files"]["engine-0.json"])) == set(json.loads(op["engine_json"]))
    for field in ("policy", "batching", "granularity", "batch_token_budget", "tp_size"):
        assert getattr(local, field) == getattr(remote, field), field
    assert local.kv is not None and remote.kv is not None
    assert local.kv.transport == remote.kv.transport
    prefill = up["children"]["prefill"].process
    kv_ports = {p["name"]: p["containerPort"] for p in op["containers"]["prefill"]["ports"]}
    if transport == "http":  # decode pulls from the KV listener the prefill process advertises
        assert prefill.kv_port == kv_ports.pop("kv") == PREFILL_KV_PORT
        advertised = _child_env(up["children"]["prefill"])["FLOWPREFILL_KV_ADVERTISE_URL"]
        assert advertised == f"http://{HOST}:{PREFILL_KV_PORT}"
    else:  # decode reads the shared volume: no KV listener
        assert prefill.kv_port is None
    assert list(kv_ports) == ["http"]


def test_a_tensor_parallel_instance_is_the_same_one_process_on_both_sides(
    tmp_path: Path,
) -> None:
    """``up --tp 2`` and a CPU pool with ``engine.tpSize: 2`` start the same single
    ``serve-prefill`` process (it spawns its ranks) with ``tp_size: 2`` in engine.json."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tp", "2", "--decode", "0"])
    plan = plan_stack(args, Path(MODEL), tmp_path / "p.json", SLOTable.paper(), tmp_path)
    (child,) = [c for c in plan.children if c.process.role.value == "prefill"]
    spec = ServingPoolSpec.model_validate(
        {"service": "m", "role": "prefill", "model": {"path": MODEL},
         "engine": {"device": "cpu", "tpSize": 2}, "resources": {"gpusPerPod": 0}}
    )  # fmt: skip
    children = build_pool_children(PoolRef("m-prefill", "ns", "u", spec), OperatorSettings())
    (dep,) = [m for m in children if m["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    paths = {f"{tmp_path}/engine-0.json": "<engine.json>", ENGINE_CONFIG_PATH: "<engine.json>"}
    launcher = len(Launcher.image().flowprefill)
    assert _normalise(list(child.process.args), paths) == _normalise(
        container["command"][launcher:], paths
    )
    (cm,) = [m for m in children if m["kind"] == "ConfigMap"]
    local = EngineConfig.model_validate_json(plan.files["engine-0.json"])
    remote = EngineConfig.model_validate_json(cm["data"]["engine.json"])
    assert local.tp_size == remote.tp_size == 2
