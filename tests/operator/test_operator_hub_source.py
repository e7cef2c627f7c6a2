"""``hf://`` model sources end to end: the operator (``kopf run`` against kmock's emulator)
checks the repository and token against a local stand-in of the Hub's file API through the
real ``huggingface_hub`` client, and the pods' download step (run here as the kubelet would
run the rendered init container) lands the files in the cache.

What must hold: the token is sent; a wrong token and a missing repository each give a
ServingPool condition and an Event naming them, with no pods created (no crash loop);
fixing the Secret lets the pool start.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowprefill.contracts.model_uri import MODEL_CACHE_MOUNT
from tests.hub_standin import HubStandIn, Repo
from tests.operator.cluster import Cluster, create, pool, running_cluster
from tests.operator.harness import wait_for

GOOD, WRONG = "hf_good_token", "hf_wrong_token"
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b"{}",
    "model-00001-of-00002.safetensors": os.urandom(300_000),
    "model-00002-of-00002.safetensors": os.urandom(200_000),
    "original/consolidated.00.pth": os.urandom(1000),  # the same weights again: skipped
}


@pytest.fixture(scope="module")
def hub() -> Iterator[HubStandIn]:
    repos = {"meta-llama/Llama-3.1-8B-Instruct": Repo(FILES, gated=True, readers={GOOD})}
    with HubStandIn(repos, tokens={GOOD}) as h:  # WRONG: a token the Hub does not know
        yield h


@pytest.fixture(scope="module")
def hub_cluster(
    hub: HubStandIn, tmp_path_factory: pytest.TempPathFactory, repo_root: Path
) -> Iterator[Cluster]:
    env = {
        "FLOWPREFILL_OPERATOR_HF_ENDPOINT": hub.url,
        "FLOWPREFILL_OPERATOR_MODEL_CHECK": "true",
        "HF_HUB_OFFLINE": "0",  # the suite runs offline (.ci/run); an operator pod does not
    }
    with running_cluster(tmp_path_factory.mktemp("kmock"), repo_root, env) as c:
        yield c


def secret(name: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "data": {"HF_TOKEN": base64.b64encode(token.encode()).decode()},
    }


def hub_pool(name: str, uri: str, token_secret: str | None) -> dict[str, Any]:
    model: dict[str, Any] = {"uri": uri}
    if token_secret:
        model["tokenSecretRef"] = {"name": token_secret}
    return pool(name, name, model=model)


def degraded(c: Cluster, ns: str, name: str) -> tuple[str, str, str]:
    status = c.get("ServingPool", ns, name).get("status") or {}
    conditions: list[dict[str, str]] = status.get("conditions", [])
    cond = next((x for x in conditions if x["type"] == "Degraded"), {})
    return cond.get("status", ""), cond.get("reason", ""), cond.get("message", "")


def test_wrong_token_is_a_condition_and_event_then_fixing_it_starts_the_pool(
    hub_cluster: Cluster, hub: HubStandIn
) -> None:
    c, ns = hub_cluster, "hub-token"
    create(c, secret("hf-token", WRONG), ns)
    create(c, hub_pool("llama", "hf://meta-llama/Llama-3.1-8B-Instruct", "hf-token"), ns)
    wait_for(lambda: degraded(c, ns, "llama")[1] == "ModelTokenRefused", what="ModelTokenRefused")
    _, _, message = degraded(c, ns, "llama")
    assert "hf://meta-llama/Llama-3.1-8B-Instruct" in message
    assert "Secret hf-token key HF_TOKEN" in message
    assert f"Bearer {WRONG}" in hub.authorizations()  # the Secret's token reached the Hub
    wait_for(lambda: "ModelTokenRefused" in c.event_reasons(ns, "llama"), what="Warning event")
    assert c.kube.get("Deployment", ns, "llama") is None  # no pods to crash-loop
    assert c.get("ServingPool", ns, "llama")["status"]["phase"] == "Degraded"

    c.kube.patch("Secret", ns, "hf-token", {"data": secret("x", GOOD)["data"]})
    wait_for(lambda: c.kube.get("Deployment", ns, "llama") is not None, what="Deployment")
    wait_for(lambda: degraded(c, ns, "llama")[0] == "False", what="Degraded cleared")


def test_missing_repository_and_missing_secret_are_named(hub_cluster: Cluster) -> None:
    c, ns = hub_cluster, "hub-missing"
    create(c, hub_pool("ghost", "hf://meta-llama/Llama-9-Nonexistent", None), ns)
    wait_for(
        lambda: degraded(c, ns, "ghost")[1] == "ModelRepositoryNotFound",
        what="ModelRepositoryNotFound",
    )
    assert "hf://meta-llama/Llama-9-Nonexistent" in degraded(c, ns, "ghost")[2]
    wait_for(lambda: "ModelRepositoryNotFound" in c.event_reasons(ns, "ghost"), what="event")
    assert c.kube.get("Deployment", ns, "ghost") is None

    create(c, hub_pool("nosecret", "hf://meta-llama/Llama-3.1-8B-Instruct", "absent"), ns)
    wait_for(lambda: degraded(c, ns, "nosecret")[1] == "TokenSecretNotFound", what="no Secret")
    assert "'absent'" in degraded(c, ns, "nosecret")[2]
    assert c.kube.get("Deployment", ns, "nosecret") is None

    # A gated model without a token: the listing is public, the files are not.
    create(c, hub_pool("gated", "hf://meta-llama/Llama-3.1-8B-Instruct", None), ns)
    wait_for(lambda: degraded(c, ns, "gated")[1] == "ModelGated", what="ModelGated")


def run_download_step(
    c: Cluster, ns: str, name: str, cache: Path, hub: HubStandIn
) -> subprocess.CompletedProcess[str]:
    """The rendered init container, run as the kubelet would: its command, its env with
    the Secret resolved, its cache volume at ``cache``; termination log in ``cache``."""
    dep = c.get("Deployment", ns, name)
    (step,) = dep["spec"]["template"]["spec"]["initContainers"]
    env = dict(os.environ)
    for var in step["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            data = c.get("Secret", ns, ref["name"])["data"][ref["key"]]
            env[var["name"]] = base64.b64decode(data).decode()
    env["HOME"] = env["XDG_CACHE_HOME"] = env["HF_HOME"] = str(cache / "home")
    assert env["HF_ENDPOINT"] == hub.url
    command = [a.replace(MODEL_CACHE_MOUNT, str(cache)) for a in step["command"]]
    assert command[0] == "flowprefill"
    # The console script of this environment (the image's is on its PATH).
    argv = [str(Path(sys.executable).parent / "flowprefill"), *command[1:]]
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "termination-log").touch()  # the kubelet creates the file before the start
    argv += ["--termination-log", str(cache / "termination-log")]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_download_step_lands_the_files_in_the_cache(
    hub_cluster: Cluster, hub: HubStandIn, tmp_path: Path
) -> None:
    c, ns = hub_cluster, "hub-download"
    create(c, secret("hf-token", GOOD), ns)
    create(c, hub_pool("llama", "hf://meta-llama/Llama-3.1-8B-Instruct", "hf-token"), ns)
    wait_for(lambda: c.kube.get("Deployment", ns, "llama") is not None, what="Deployment")
    done = run_download_step(c, ns, "llama", tmp_path, hub)
    assert done.returncode == 0, done.stderr
    model = tmp_path / "hf/meta-llama/Llama-3.1-8B-Instruct/main"
    for file in ("config.json", "tokenizer.json", "model-00002-of-00002.safetensors"):
        assert (model / file).read_bytes() == FILES[file]
    assert not (model / "original").exists()
    assert "[5/5]" in done.stderr  # one progress line per file, in the pod's log
    again = run_download_step(c, ns, "llama", tmp_path, hub)
    assert again.returncode == 0 and "already in" in again.stderr

    # The token rotated to a wrong one after the pods were made: the step fails with a
    # permanent exit code and its one-line reason in the termination log.
    c.kube.patch("Secret", ns, "hf-token", {"data": secret("x", WRONG)["data"]})
    failed = run_download_step(c, ns, "llama", tmp_path / "other", hub)
    assert failed.returncode == 2
    reason = (tmp_path / "other" / "termination-log").read_text()
    assert reason.startswith("ModelTokenRefused: hf://meta-llama/Llama-3.1-8B-Instruct")


def test_a_failed_gateway_tokenizer_download_is_reported_by_its_pool(hub_cluster: Cluster) -> None:
    c, ns = hub_cluster, "hub-gateway"
    create(c, secret("hf-token", GOOD), ns)
    create(c, hub_pool("tok", "hf://meta-llama/Llama-3.1-8B-Instruct", "hf-token"), ns)
    wait_for(lambda: c.kube.get("Deployment", ns, "tok-gateway") is not None, what="gateway")
    labels = c.get("Deployment", ns, "tok-gateway")["spec"]["selector"]["matchLabels"]
    message = "ModelGated: hf://meta-llama/Llama-3.1-8B-Instruct is gated and ..."
    gateway_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "tok-gateway-abc", "labels": labels},
        "spec": {"containers": [{"name": "gateway", "image": "i"}]},
        "status": {
            "phase": "Pending",
            "initContainerStatuses": [
                {
                    "name": "fetch-tokenizer",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 2, "message": message}},
                }
            ],
        },
    }
    create(c, gateway_pod, ns)
    wait_for(lambda: degraded(c, ns, "tok")[1] == "ModelGated", what="ModelGated from gateway")
    assert "tok-gateway-abc: fetch-tokenizer" in degraded(c, ns, "tok")[2]
