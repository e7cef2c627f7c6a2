"""Smoke-run the images scripts/build_images.sh built, as the operator's pods run them.

Each image runs the command, environment and volumes its pod gets (the operator's builders
for prefill and gateway, the Helm chart's for the operator), under the conditions of
scripts/image_sandbox.py (read-only root, writable only the pod's emptyDirs, the image's
non-root USER, no privileges), and must then do its job:

- prefill: answers ``/health`` and serves a ``POST /v1/prefill`` on the tiny built-in model
  (built on the host, mounted read-only where the pod mounts the model PVC);
- gateway: answers ``/health`` with the gateway.json and SLO table the operator renders;
- operator: ``kopf run`` with the chart's arguments imports the handlers module and gets as
  far as logging in (no cluster here: it must fail there, and only there), and the
  handlers module registers its kopf handlers in the image;
- decode: runs the image's Python (3.12 in vLLM's image and in its stand-in) with the
  project installed ``--no-deps``, and imports vLLM and the FlowPrefill KV connector the
  decode command names, which must be a vLLM v1 KV connector (on the stand-in, which has
  no torch for 3.12, that import runs in the same Dockerfile built on the CPU vLLM
  stand-in; serving a model with vLLM on CPU is left to docs/kv.md);
- prefill, gateway and decode: the ``flowprefill`` console script is on PATH and its
  ``fetch-model`` step (the pods' download init step) answers ``--help``.

Every image runs twice: as its own numeric USER, and as an arbitrary UID with GID 0 and no
passwd entry, as OpenShift's restricted-v2 runs it (``ARBITRARY``). While a server runs,
every one of its processes is checked from the host (image_sandbox.check_hardened).
Usage: ``python scripts/smoke_images.py [--registry localhost/flowprefill] [--tag dev]
NAME...`` (as root, with the repository's venv: it imports flowprefill and
flowprefill_operator).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flowprefill_operator.builders.common import PoolRef
from flowprefill_operator.builders.gateway import build_gateway_children
from flowprefill_operator.builders.pool import build_pool_children, pool_process
from flowprefill_operator.models import ServingPoolSpec
from flowprefill_operator.settings import OperatorSettings
from image_sandbox import (
    WORK_DIR,
    ImageConfig,
    PodMounts,
    Sandboxed,
    check_hardened,
    host_tool,
    inspect_processes,
    probe_writes,
    run_in_image,
)

from flowprefill.contracts import SLOTable
from flowprefill.contracts.deployment import HEALTH_PATH, PREFILL_API_PATH
from flowprefill.contracts.prefill_api import PrefillResponse

MODEL = "tiny-llama"
MODEL_MOUNT = "/models"
POD_IP = "127.0.0.1"
OPERATOR_EMPTY_DIRS = ["/tmp"]  # charts/flowprefill/templates/deployment.yaml: volume "tmp"
ARBITRARY = (1000650000, 0)
"""OpenShift restricted-v2: a UID from the namespace's range (not in the image's passwd),
primary GID 0. The pods set no runAsUser, so this is what such a cluster runs."""
Manifest = dict[str, Any]
RunAs = tuple[int, int] | None
"""None: the image's USER; else (uid, gid)."""


def who(run_as: RunAs) -> str:
    return "the image's USER" if run_as is None else f"UID {run_as[0]} GID {run_as[1]}"


def pool(role: str) -> PoolRef:
    spec = ServingPoolSpec.model_validate(
        {
            "service": "smoke",
            "role": role,
            # The claim "models" holds the model directory; the operator mounts that
            # subdirectory read-only at MODEL_MOUNT.
            "model": {"uri": f"pvc://models/{MODEL}"},
            "resources": {"gpusPerPod": 0, "cpu": "1"},
        }
        | ({"engine": {"device": "cpu", "dtype": "float32"}} if role == "prefill" else {})
    )
    return PoolRef(name=f"smoke-{role}", namespace="default", uid=f"uid-{role}", spec=spec)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((POD_IP, 0))
        return int(s.getsockname()[1])


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and env values."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def pod_container(
    children: list[Manifest], model_dir: Path, files: Path
) -> tuple[list[str], dict[str, str], PodMounts]:
    """The container of the one Deployment in ``children``, made runnable here: its
    ConfigMaps written to ``files``, the model PVC bound to ``model_dir``."""
    configmaps = {c["metadata"]["name"]: c["data"] for c in children if c["kind"] == "ConfigMap"}
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env: dict[str, str] = {}
    for item in container["env"]:
        if "valueFrom" in item:  # status.podIP
            env[item["name"]] = POD_IP
        else:
            env[item["name"]] = expand(item["value"], env)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = PodMounts()
    for mount in container["volumeMounts"]:
        volume, target = volumes[mount["name"]], mount["mountPath"]
        if "emptyDir" in volume:
            mounts.empty_dirs.append(target)
        elif "configMap" in volume:
            data = configmaps[volume["configMap"]["name"]]
            folder = files / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            for key, text in data.items():
                (folder / key).write_text(text)
            sub = mount.get("subPath")
            mounts.read_only[target] = folder / sub if sub else folder
        elif "persistentVolumeClaim" in volume:  # the model claim; model_dir is its root
            sub = mount.get("subPath")
            mounts.read_only[target] = model_dir / sub if sub else model_dir
        else:
            raise SystemExit(f"volume {volume} not reproduced by the smoke run")
    argv = [expand(a, env) for a in container["command"]]
    return argv, env, mounts


def wait_http(run: Sandboxed, url: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            raise AssertionError(f"exited with {run.proc.returncode}:\n{run.output()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return int(answer.status)
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise AssertionError(f"no answer from {url} in {timeout_s:.0f} s:\n{run.output()[-3000:]}")


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return dict(json.loads(answer.read()))


def report_hardened(run: Sandboxed, image: str, empty_dirs: list[str], run_as: RunAs) -> None:
    uid, _ = ImageConfig.of(image).uid_gid() if run_as is None else run_as
    facts = inspect_processes(run)
    check_hardened(facts, uid, empty_dirs, None if run_as is None else run_as[1])
    for f in facts:
        print(f"    pid {f.pid} uid {f.uids[0]} gid {f.gids[0]} groups {list(f.groups)} "
              f"no_new_privs {f.no_new_privs} caps {f.cap_eff:#x} / ro {f.root_read_only} "
              f"writable {list(f.writable_mounts)}: {f.command[:70]}")  # fmt: skip


def serve(image: str, children: list[Manifest], model_dir: Path, name: str) -> Callable[..., None]:
    """Start the pod's server on a free port; hand (run, base_url) to a probe."""

    def go(probe: Callable[[Sandboxed, str], None], run_as: RunAs) -> None:
        files = WORK_DIR / f"{name}-files-{os.getpid()}"
        argv, env, mounts = pod_container(children, model_dir, files)
        port = free_port()
        # The host's network is shared with other programs: a free port, on loopback.
        argv += ["--host", POD_IP, "--port", str(port)]
        print(f"  {name} as {who(run_as)}: {' '.join(argv)}")
        print(f"    emptyDirs {mounts.empty_dirs}, read-only {sorted(mounts.read_only)}")
        try:
            with run_in_image(image, argv, env, mounts, name, run_as) as run:
                base = f"http://{POD_IP}:{port}"
                assert wait_http(run, base + HEALTH_PATH, timeout_s=300) == 200
                probe(run, base)
                report_hardened(run, image, mounts.empty_dirs, run_as)
            writes = probe_writes(image, mounts, name, run_as)
            print(f"    writes as {who(run_as)}: {writes}")
        finally:
            shutil.rmtree(files, ignore_errors=True)

    return go


def smoke_prefill(image: str, model_dir: Path, run_as: RunAs) -> None:
    def probe(run: Sandboxed, base: str) -> None:
        prompt = list(range(1, 33))
        body = {"request_id": "smoke-1", "prompt_token_ids": prompt, "ttft_slo_s": 60.0}
        answer = PrefillResponse.model_validate(post_json(base + PREFILL_API_PATH, body))
        assert answer.num_prompt_tokens == len(prompt), answer
        print(f"    prefill answered: first token {answer.first_token_id}, "
              f"{answer.num_prompt_tokens} tokens, ttft {answer.ttft_s * 1000:.0f} ms")  # fmt: skip

    serve(image, build_pool_children(pool("prefill"), OperatorSettings()), model_dir, "prefill")(
        probe, run_as
    )


def smoke_gateway(image: str, model_dir: Path, run_as: RunAs) -> None:
    table = SLOTable.model_validate(
        {"default_class": "chat", "classes": [{"name": "chat", "task_type": "text",
         "ttft_slo_ms": 500, "priority": 1, "attainment_target": 0.9}]}
    )  # fmt: skip
    pools = [pool("prefill"), pool("decode")]
    children = build_gateway_children(pools, table, OperatorSettings())

    def probe(run: Sandboxed, base: str) -> None:
        print(f"    /health 200, /metrics {wait_http(run, base + '/metrics', timeout_s=30)}")

    serve(image, children, model_dir, "gateway")(probe, run_as)


def smoke_operator(image: str, run_as: RunAs) -> None:
    config = ImageConfig.of(image)
    # The chart's command and arguments (watch scope cluster, no peering), liveness moved to
    # a free port.
    argv = [*config.entrypoint, *config.cmd]
    argv = [a for a in argv if not a.startswith("--liveness")]
    argv.append(f"--liveness=http://{POD_IP}:{free_port()}/healthz")
    mounts = PodMounts(empty_dirs=list(OPERATOR_EMPTY_DIRS))
    env = {"POD_NAME": "flowprefill-operator-smoke"}
    print(f"  operator as {who(run_as)}: {' '.join(argv)}")
    # No cluster here: kopf imports the handlers module and runs its startup handler, which
    # fails to load a kube config and is retried every 60 s. That failure, in a handler of
    # ours, is the sign it got that far; the process is checked while it retries.
    started = re.compile(r"Activity '([\w.]+)' failed with an exception and will try again")
    with run_in_image(image, argv, env, mounts, "operator", run_as) as run:
        deadline = time.monotonic() + 240
        while not started.search(run.output()):
            assert run.proc.poll() is None, f"kopf exited {run.proc.returncode}:\n{run.output()}"
            assert time.monotonic() < deadline, f"kopf not started in 240 s:\n{run.output()}"
            time.sleep(0.5)
        out = run.output()
        assert re.search(r"kube-config|Service host/port", out), out[-3000:]
        report_hardened(run, image, mounts.empty_dirs, run_as)
    match = started.search(out)
    assert match is not None and "ModuleNotFoundError" not in out, out[-3000:]
    print(
        f"    kopf started; startup handler {match.group(1)!r} failed at the kube config (no "
        "cluster) and was being retried"
    )

    count = (
        "import kopf, flowprefill_operator.handlers as h; r = kopf.get_default_registry(); "
        "n = {k: len(v.get_all_handlers()) for k, v in vars(r).items()}; print(n); "
        "assert n['_changing'] and n['_activities'], n"
    )
    with run_in_image(
        image, ["python", "-c", count], env, mounts, "operator-handlers", run_as
    ) as run:
        code = run.proc.wait(timeout=180)
        assert code == 0, run.output()[-3000:]
        print(f"    handlers registered in the image: {run.output().strip().splitlines()[-1]}")
    print(f"    writes as {who(run_as)}: {probe_writes(image, mounts, 'operator', run_as)}")


def run_to_end(
    image: str, argv: list[str], name: str, run_as: RunAs, timeout_s: float = 300
) -> str:
    """Run ``argv`` in ``image`` with the pod's /tmp emptyDir; its output, or AssertionError
    with the output when it exits non-zero."""
    mounts = PodMounts(empty_dirs=["/tmp"])
    with run_in_image(image, argv, {}, mounts, name, run_as) as run:
        code = run.proc.wait(timeout=timeout_s)
        assert code == 0, f"{' '.join(argv)[:200]} exited {code}:\n{run.output()[-3000:]}"
        return run.output()


def smoke_fetch_model(image: str, name: str, run_as: RunAs) -> None:
    """The pods' download step runs ``flowprefill fetch-model`` in this image (an init
    container): the console script must be on PATH, its Python must import the step."""
    out = run_to_end(image, ["flowprefill", "fetch-model", "--help"], f"{name}-fetch", run_as)
    assert "--dest" in out and "--tokenizer-only" in out, out[-2000:]
    print(f"    flowprefill fetch-model --help as {who(run_as)}: {out.strip().splitlines()[0]}")


def connector_code() -> str:
    """Python that imports the KV connector the operator's decode command names and checks
    it is a vLLM v1 KV connector."""
    command = pool_process(pool("decode").spec).argv
    connector = json.loads(command[command.index("--kv-transfer-config") + 1])
    return (
        "import importlib, sys, vllm\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
        f"m = importlib.import_module({connector['kv_connector_module_path']!r})\n"
        f"c = getattr(m, {connector['kv_connector']!r})\n"
        "assert issubclass(c, KVConnectorBase_V1), c\n"
        "print('python', sys.version.split()[0], 'vllm', vllm.__version__, "
        "c.__module__ + '.' + c.__name__)\n"
    )


PYTHON_FACTS = (
    "import importlib.util, shutil, sys, sysconfig\n"
    "import flowprefill, flowprefill.contracts, flowprefill.fetch\n"
    # The connector's own source must at least compile under this Python; it is imported
    # below wherever vLLM is importable.
    "import py_compile\n"
    # (by path: importing flowprefill.kv imports torch)
    "src = flowprefill.__path__[0] + '/kv/connector.py'\n"
    "py_compile.compile(src, cfile='/tmp/connector.pyc', doraise=True)\n"
    "print(sys.version_info[0], sys.version_info[1], shutil.which('flowprefill'), "
    "sysconfig.get_path('scripts'), importlib.util.find_spec('vllm') is not None)\n"
)


def smoke_decode(image: str, fallback: str, run_as: RunAs) -> None:
    """The connector's import under vLLM runs in the decode image itself when it has vLLM
    (built on vLLM's image), else in ``fallback``: the same Dockerfile built on the CPU vLLM
    stand-in (scripts/build_images.sh --stand-ins), which must then exist."""
    facts = run_to_end(image, ["python3", "-c", PYTHON_FACTS], "decode-python", run_as)
    major, minor, script, scripts_dir, has_vllm = facts.strip().splitlines()[-1].split()
    print(
        f"    python {major}.{minor}; flowprefill at {script} (scripts dir {scripts_dir}); "
        "flowprefill.contracts, flowprefill.fetch imported; kv/connector.py compiled"
    )
    assert script != "None", "the flowprefill console script is not on PATH"
    smoke_fetch_model(image, "decode", run_as)
    connector_image = image if has_vllm == "True" else fallback
    if connector_image != image and not image_exists(connector_image):
        raise AssertionError(f"{image} has no vLLM and {connector_image} was not built")
    where = "" if connector_image == image else f" (in {connector_image}: {image} has no vLLM)"
    out = run_to_end(connector_image, ["python3", "-c", connector_code()], "decode", run_as)
    print(f"    {out.strip().splitlines()[-1]}{where}")
    mounts = PodMounts(empty_dirs=["/tmp"])
    print(f"    writes as {who(run_as)}: {probe_writes(image, mounts, 'decode', run_as)}")


def fs_group(volume: Path, gid: int) -> None:
    """What the pods' fsGroup does to a volume: group-owned by it and group-readable (the
    saved model is 0700/0600, root's own, and unreadable to the image's user otherwise).
    The arbitrary-UID run gets GID 0 here: the sandbox drops supplementary groups, so the
    volume is handed to the run's primary group instead of an fsGroup supplementary one."""
    for path in [volume, *volume.rglob("*")]:
        os.chown(path, -1, gid)
        path.chmod(path.stat().st_mode | (0o050 if path.is_dir() else 0o040))


def image_exists(image: str) -> bool:
    found = subprocess.run(
        ["buildah", "images", "--quiet", image],
        capture_output=True,
        env={**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "overlay")},
    )
    return found.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", default="localhost/flowprefill")
    parser.add_argument("--tag", default="dev")
    parser.add_argument(
        "--connector-image",
        help="where the decode connector's import runs if the decode image has no vLLM "
        "(default localhost/flowprefill/decode-vllm-cpu:TAG, built by build_images.sh "
        "--stand-ins)",
    )
    parser.add_argument("names", nargs="+", choices=["operator", "gateway", "prefill", "decode"])
    args = parser.parse_args()
    for tool in ("buildah", "unshare", "setpriv", "mount"):
        host_tool(tool)
    from flowprefill.models.loader import named_model_dir

    # The model claim's content: <claim>/<model>, as the pool's pvc://models/<model> names it.
    pvc = WORK_DIR / "model-pvc"
    if not (pvc / MODEL).is_dir():
        shutil.copytree(named_model_dir(MODEL, cache_dir=WORK_DIR / "models"), pvc / MODEL)
    for name in args.names:
        image = f"{args.registry.rstrip('/')}/{name}:{args.tag}"
        print(f"smoke {image}")
        start = time.monotonic()
        for run_as in (None, ARBITRARY):
            gid = ImageConfig.of(image).uid_gid()[1] if run_as is None else run_as[1]
            fs_group(pvc, gid)
            if name == "prefill":
                smoke_prefill(image, pvc, run_as)
                smoke_fetch_model(image, name, run_as)
            elif name == "gateway":
                smoke_gateway(image, pvc, run_as)
                smoke_fetch_model(image, name, run_as)
            elif name == "operator":
                smoke_operator(image, run_as)
            else:
                standin = f"localhost/flowprefill/decode-vllm-cpu:{args.tag}"
                smoke_decode(image, args.connector_image or standin, run_as)
        print(f"  {name}: OK in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
