"""End to end, a colocated pod on CPU: the official ``openai`` client → ``flowprefill
serve-gateway`` → the colocated pod's launcher (``python -m flowprefill_operator.colocated
run``), which runs the real prefill server and stock vLLM decode side by side, the KV
handed over NIXL inside the "pod"; greedy tokens equal those of ``vllm serve`` alone on the
same model (chat and completions, streamed and not).

What runs is what the operator renders for a ``role: colocated`` pool on CPU
(``gpusPerPod: 0``, ``engine.device: cpu``, ``kvHandoff.transport: nixl``): the container's
launch spec, env and engine.json, and the service's gateway.json. Rewritten, and only
that, is what must differ on this machine (:func:`localize`): free loopback ports instead
of the pod's fixed ones, the pod IP (downward API) as 127.0.0.1, the engine.json path,
scratch directories, the interpreter, and the environment ``flowprefill up`` gives vLLM on
a CPU host. The model is a locally built demo model, named by ``model.path``.

Pairing: the gateway lists the pod as prefill and decode *and* a decode pool (the
vLLM-alone server, as when a decode pool joins the service). Without pairing, decode's
least-loaded routing rotates its ties across both; with it, every decode the gateway sends
goes to the pod that prefilled the request, which vLLM's own request counters show.

Needs vLLM and nixl; skipped with the reason where they are missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from flowprefill_operator.builders import PoolRef, build_pool_children
from flowprefill_operator.builders.gateway import build_gateway_config
from flowprefill_operator.colocated import Child, LaunchSpec
from flowprefill_operator.models import ServingPoolSpec
from flowprefill_operator.settings import OperatorSettings
from openai.types.chat import ChatCompletionMessageParam

from flowprefill.contracts import Endpoint, GatewayConfig
from flowprefill.contracts.deployment import POD_IP_ENV
from flowprefill.models import named_model_dir
from flowprefill.stack.decode import decode_env, vllm_server_command
from tests.helpers import free_port, wait_vllm
from tests.kv.nixl.test_vllm_consumer import nixl_bytes
from tests.operator.crdcheck import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None,
        reason="needs vLLM and nixl (pip install -e '.[up]')",
    ),
]

LOOPBACK = "127.0.0.1"
MAX_MODEL_LEN = 2048
TABLE = {
    "version": 1,
    "default_class": "chat",
    "classes": [
        {"name": "chat", "task_type": "text", "ttft_slo_ms": 30000, "priority": 10,
         "attainment_target": 0.9},
    ],
}  # fmt: skip


def colocated_pool(model_dir: Path) -> PoolRef:
    """A colocated pool on CPU nodes, KV over NIXL inside the pod, vLLM as this machine runs
    it (float32, eager: ``flowprefill up``'s decode arguments)."""
    spec = ServingPoolSpec.model_validate(
        {
            "service": "m",
            "role": "colocated",
            "model": {"path": str(model_dir)},
            "engine": {"device": "cpu", "dtype": "float32"},
            "resources": {"gpusPerPod": 0, "cpu": "1"},
            "kvHandoff": {"transport": "nixl"},
            "vllmArgs": ["--dtype=float32", "--enforce-eager", f"--max-model-len={MAX_MODEL_LEN}"],
        }
    )
    return PoolRef("m-colo", "ns", "uid-c", spec)


def decode_pool(model_dir: Path) -> PoolRef:
    spec = ServingPoolSpec.model_validate(
        {"service": "m", "role": "decode", "model": {"path": str(model_dir)}}
    )
    return PoolRef("m-decode", "ns", "uid-d", spec)


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)  # ValueError when the rendered command lacks it: the test is stale
    return [*argv[: i + 1], value, *argv[i + 2 :]]


def localize(
    container: dict[str, Any], engine_json: str, tmp: Path, ports: dict[str, int]
) -> tuple[LaunchSpec, dict[str, str]]:
    """The rendered container's launch spec and env, made to run on this machine (module
    docstring). ``ports``: free loopback ports for prefill, decode, health and the two NIXL
    side channels."""
    assert container["command"][:4] == ["python", "-m", "flowprefill_operator.colocated", "run"]
    # The kubelet expands $(POD_IP) in the command from the container's env (downward API).
    spec = LaunchSpec.parse(container["command"][4].replace(f"$({POD_IP_ENV})", LOOPBACK))
    engine = json.loads(engine_json)
    engine["kv"]["nixl"]["side_channel_port"] = ports["prefill-nixl"]
    (tmp / "engine.json").write_text(json.dumps(engine))
    p, d = spec.prefill, spec.decode
    prefill_argv = _set_flag(p.argv, "--config", str(tmp / "engine.json"))
    prefill_argv = _set_flag(prefill_argv, "--port", str(ports["prefill"]))
    rendered_decode_url = prefill_argv[prefill_argv.index("--colocated-decode-url") + 1]
    assert rendered_decode_url == f"http://{LOOPBACK}:{d.port}"  # the pod's IP, decode's port
    prefill_argv = _set_flag(
        prefill_argv, "--colocated-decode-url", f"http://{LOOPBACK}:{ports['decode']}"
    )
    decode_argv = _set_flag(d.argv, "--port", str(ports["decode"]))
    decode_own = {**d.env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports["decode-nixl"])}
    local = LaunchSpec(
        prefill=Child(p.name, prefill_argv, ports["prefill"], p.ready_path, p.health_path,
                      dict(p.env), p.memory_fraction),
        decode=Child(d.name, decode_argv, ports["decode"], d.ready_path, d.health_path,
                     {**decode_env(tmp / "decode"), **decode_own}),
        health_port=ports["health"],
        stop_timeout_s=30.0,
    )  # fmt: skip
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:  # the downward API's pod IP (POD_IP, VLLM_NIXL_SIDE_CHANNEL_HOST)
            assert item["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, item
            env[item["name"]] = LOOPBACK
    home = tmp / "scratch"  # the pod's /tmp emptyDir
    env |= {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    return local, env


def request_count(url: str) -> float:
    """Requests vLLM at ``url`` has finished (every finish reason)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready: {log.read_text()[-4000:]}"
        time.sleep(1)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("colocated")
    model_dir = named_model_dir("demo-llama", cache_dir=tmp / "models")
    colo, dec = colocated_pool(model_dir), decode_pool(model_dir)
    settings = OperatorSettings()
    engine_cm, deployment, _ = build_pool_children(colo, settings)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    names = ("prefill", "decode", "health", "prefill-nixl", "decode-nixl", "alone", "gateway")
    ports = {name: free_port() for name in names}
    launch, pod_env = localize(container, engine_cm["data"]["engine.json"], tmp, ports)
    bin_dir = str(Path(sys.executable).parent)  # the image's `python` and `flowprefill`
    procs: list[subprocess.Popen[bytes]] = []
    try:
        pod_log = tmp / "pod.log"
        pod_env |= {
            "PYTHONPATH": str(ROOT / "operator"),
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "flowprefill_operator.colocated", "run", launch.to_json()],
                stdout=pod_log.open("wb"),
                stderr=subprocess.STDOUT,
                env={**os.environ, **pod_env},
            )
        )
        alone_log = tmp / "alone.log"
        alone_url = f"http://{LOOPBACK}:{ports['alone']}"
        alone = subprocess.Popen(
            vllm_server_command(model_dir, ports["alone"], MAX_MODEL_LEN),
            stdout=alone_log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **decode_env(tmp / "alone")},
        )
        procs.append(alone)
        _wait_ready(f"http://{LOOPBACK}:{ports['health']}/ready", procs[0], pod_log, 900)
        wait_vllm(alone_url, alone, alone_log)

        # The service's gateway.json as the operator renders it, the pool Services' names
        # replaced by where the processes listen here.
        rendered = build_gateway_config([colo, dec], settings)
        where = {
            ("m-colo", 8100): ports["prefill"],
            ("m-colo", 8200): ports["decode"],
            ("m-decode", 8200): ports["alone"],
        }

        def local(e: Endpoint) -> Endpoint:
            return Endpoint.at(e.pool, LOOPBACK, where[(e.pool, e.port)])

        config = GatewayConfig.model_validate(
            rendered.model_dump()
            | {
                "prefill": [local(e).model_dump() for e in rendered.prefill],
                "decode": [local(e).model_dump() for e in rendered.decode],
            }
        )
        assert [e.pool for e in config.decode] == ["m-colo", "m-decode"]
        (tmp / "gateway.json").write_text(config.model_dump_json())
        (tmp / "slo.json").write_text(json.dumps(TABLE))
        gw_log = tmp / "gateway.log"
        gw_url = f"http://{LOOPBACK}:{ports['gateway']}"
        gw = subprocess.Popen(
            [str(Path(bin_dir) / "flowprefill"), "serve-gateway", "--config",
             str(tmp / "gateway.json"), "--slo-table", str(tmp / "slo.json"),
             "--host", LOOPBACK, "--port", str(ports["gateway"])],
            stdout=gw_log.open("wb"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        procs.append(gw)
        _wait_ready(f"{gw_url}/ready", gw, gw_log, 120)
        yield {
            "gw": gw_url,
            "alone": alone_url,
            "decode": f"http://{LOOPBACK}:{ports['decode']}",
            "prefill": f"http://{LOOPBACK}:{ports['prefill']}",
            "model": config.model_name,
            "model_dir": str(model_dir),
            "pod_log": pod_log,
        }
    finally:
        for proc in reversed(procs):
            _stop(proc)


def test_colocated_pod_serves_vllm_alones_tokens_and_decodes_where_it_prefilled(
    served: dict[str, Any],
) -> None:
    alone = openai.OpenAI(base_url=f"{served['alone']}/v1", api_key="none", max_retries=0,
                          timeout=300)  # fmt: skip
    ids = [(37 * i) % 30000 + 5 for i in range(300)]
    msgs: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me about prefill scheduling on one GPU."}
    ]
    name = served["model_dir"]  # vLLM alone serves the model under its path
    want_text = alone.completions.create(model=name, prompt=ids, max_tokens=12, temperature=0)
    want_chat = alone.chat.completions.create(
        model=name, messages=msgs, max_tokens=12, temperature=0
    )
    expected_text = want_text.choices[0].text
    expected_chat = want_chat.choices[0].message.content
    assert expected_text and expected_chat

    decodes_before, alone_before = request_count(served["decode"]), request_count(served["alone"])
    pulled_before = nixl_bytes(served["decode"])
    c = openai.OpenAI(base_url=f"{served['gw']}/v1", api_key="none", max_retries=0, timeout=300)
    model = served["model"]
    resp = c.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected_text
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    streamed = c.completions.create(
        model=model, prompt=ids, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == expected_text
    chat = c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == expected_chat
    parts = c.chat.completions.create(
        model=model, messages=msgs, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices) == (
        expected_chat
    )

    # Pairing: all four decodes ran in the pod that prefilled them, none in the decode pool
    # (least-loaded routing alone would have rotated them across both), and the pod's vLLM
    # pulled their KV over NIXL from the prefill beside it.
    deadline = time.monotonic() + 30
    while request_count(served["decode"]) - decodes_before < 4:
        assert time.monotonic() < deadline, "the pod's vLLM did not finish 4 requests"
        time.sleep(0.5)
    assert request_count(served["decode"]) - decodes_before == 4
    assert request_count(served["alone"]) == alone_before
    assert nixl_bytes(served["decode"]) > pulled_before
    assert "colocated with decode" in served["pod_log"].read_text()
