"""The operator in namespaced mode works with exactly the Role the chart renders.

kmock's emulator, subclassed to enforce RBAC on the operator's requests: allowed are the
rules of the chart's Role in each watched namespace and API discovery (``/api``, ``/apis``:
open to every authenticated user through Kubernetes' ``system:discovery``); everything
else, cluster-wide lists and watches included, is 403. Creating an object with
``blockOwnerDeletion`` on an ownerReference also needs update on the owner's
``/finalizers`` (the OwnerReferencesPermissionEnforcement admission plugin, on in
OpenShift). The operator runs as ``kopf run``
with the arguments of the chart's Deployment. Examples applied in the watched namespace get
their children and status; the only requests refused are the ones kopf falls back from
(listing namespaces, watching CRDs), so nothing cluster-wide is needed.
"""

from __future__ import annotations

import base64
import copy
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import pytest
import yaml

import tests.operator.emulator as emulator_module
from tests.operator.chart import operator_roles, render
from tests.operator.conftest import load_docs
from tests.operator.emulator import ClusterEmulator, EmulatorThread
from tests.operator.harness import free_port, kube_for, wait_for

WATCHED = "team-a"
OPERATOR_TOKEN = "operator-token"
VERBS = {
    kmock.action.FETCH: "get",
    kmock.action.LIST: "list",
    kmock.action.WATCH: "watch",
    kmock.action.CREATE: "create",
    kmock.action.DELETE: "delete",
}


class RBACEmulator(ClusterEmulator):
    """Requests with the operator's token are checked against ``rules`` (namespace ->
    Role rules); refused ones are recorded as (verb, group/resource, namespace)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.rules: dict[str, list[dict[str, Any]]] = {}
        self.refused: set[tuple[str, str, str | None]] = set()
        self.checked = 0  # the operator's requests held against the rules

    def _permits(self, verb: str, group: str, resource: str, namespace: str | None) -> bool:
        rules = self.rules.get(namespace or "", [])  # a Role grants nothing cluster-scoped
        return any(
            group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
            for r in rules
        )

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock 0.8 cannot parse /api/v1/namespaces (../shared/notes/kopf-kmock.md): refuse
        # the operator's before kmock tries; a Role cannot grant a cluster-scoped resource.
        if raw_request.path == "/api/v1/namespaces" and self._is_operator(raw_request.headers):
            verb = "watch" if raw_request.query.get("watch") in ("true", "1") else "list"
            self.refused.add((verb, "core/namespaces", None))
            return await self._render_error(
                kmock.KubernetesError(status=403, reason="Forbidden", message="RBAC")
            )
        return await super().__call__(raw_request)

    @staticmethod
    def _is_operator(headers: Any) -> bool:
        return bool(headers.get("Authorization", "") == f"Bearer {OPERATOR_TOKEN}")

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if self._is_operator(request.headers) and res is not None and res.plural is not None:
            method = request.method.upper()
            verb = VERBS.get(request.action) if request.action is not None else None
            verb = verb or ("patch" if method == "PATCH" else "update")
            resource = res.plural + (f"/{request.subresource}" if request.subresource else "")
            self.checked += 1
            needed = [(verb, res.group or "", resource)]
            if verb == "create":
                needed += self._owner_permissions(request.data)
            for verb_, group, resource_ in needed:
                if not self._permits(verb_, group, resource_, request.namespace):
                    self.refused.add((verb_, f"{group or 'core'}/{resource_}", request.namespace))
                    return await self._render_error(
                        kmock.KubernetesError(status=403, reason="Forbidden", message="RBAC")
                    )
        return await super()._handle(request)

    @staticmethod
    def _owner_permissions(body: Any) -> list[tuple[str, str, str]]:
        """OwnerReferencesPermissionEnforcement (OpenShift enables it): an object created
        with blockOwnerDeletion on an ownerReference needs update on the owner's
        finalizers subresource (owner kinds here are plural by a trailing s)."""
        owners = ((body or {}).get("metadata") or {}).get("ownerReferences") or []
        return [
            ("update", ref["apiVersion"].rpartition("/")[0], f"{ref['kind'].lower()}s/finalizers")
            for ref in owners
            if ref.get("blockOwnerDeletion")
        ]


def _kubeconfig(emulator: EmulatorThread, path: Path, token: str | None) -> Path:
    emulator.write_kubeconfig(path)
    if token:
        config = yaml.safe_load(path.read_text())
        config["users"][0]["user"] = {"token": token}
        path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def namespaced(
    tmp_path_factory: pytest.TempPathFactory, repo_root: Path
) -> Iterator[dict[str, Any]]:
    docs = render(
        "--set", "watch.scope=namespaced", "--set", f"watch.namespaces={{{WATCHED}}}",
        # No Hub here: the value an offline cluster sets (the pods' download step reports).
        "--set", "modelSources.check=false",
    )  # fmt: skip
    rules = {d["metadata"]["namespace"]: d["rules"] for d in operator_roles(docs)}
    assert set(rules) == {WATCHED}
    dep = next(d for d in docs if d["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    port = free_port()
    args = [
        f"--liveness=http://127.0.0.1:{port}/healthz" if a.startswith("--liveness=") else a
        for a in container["args"]
    ]
    assert f"--namespace={WATCHED}" in args and "--all-namespaces" not in args
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["FLOWPREFILL_OPERATOR_RECONCILE_INTERVAL_S"] = "1"

    tmp = tmp_path_factory.mktemp("rbac")
    mp = pytest.MonkeyPatch()
    mp.setattr(emulator_module, "ClusterEmulator", RBACEmulator)
    emu = EmulatorThread(sorted((repo_root / "crds").glob("*.yaml"))).start()
    mp.undo()
    assert isinstance(emu.emulator, RBACEmulator)
    emu.emulator.rules = rules
    admin = kube_for(_kubeconfig(emu, tmp / "admin.yaml", None))
    operator_config = _kubeconfig(emu, tmp / "operator.yaml", OPERATOR_TOKEN)
    log = (tmp / "operator.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", *container["command"], *args],
        env={**os.environ, **env, "KUBECONFIG": str(operator_config), "POD_NAME": "op-0"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield {"emulator": emu.emulator, "kube": admin, "proc": proc, "log": tmp / "operator.log"}
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        emu.stop()


def _apply(kube: Any, path: Path, namespace: str) -> None:
    for doc in load_docs(path):
        doc = copy.deepcopy(doc)
        doc["metadata"]["namespace"] = namespace
        kube.create(doc)


def test_the_chart_role_is_enough_in_namespaced_mode(
    namespaced: dict[str, Any], repo_root: Path
) -> None:
    kube, emu = namespaced["kube"], namespaced["emulator"]
    for ns in (WATCHED, "team-b"):
        # The examples' hf:// pools read their Hub token from this Secret (the operator
        # holds pods back while it is missing).
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "hf-token", "namespace": ns},
                "data": {"HF_TOKEN": base64.b64encode(b"hf_example").decode()},
            }
        )
        _apply(kube, repo_root / "examples" / "slo-classes.yaml", ns)
        _apply(kube, repo_root / "examples" / "llama3-8b.yaml", ns)

    def reconciled() -> bool:
        assert namespaced["proc"].poll() is None, namespaced["log"].read_text()[-3000:]
        names = {o["metadata"]["name"] for o in kube.list("Deployment", WATCHED)}
        pool = kube.get("ServingPool", WATCHED, "llama3-8b-prefill") or {}
        return {"llama3-8b-prefill", "llama3-8b-decode", "llama3-8b-gateway"} <= names and bool(
            (pool.get("status") or {}).get("conditions")
        )

    wait_for(reconciled, 60, "children and status in the watched namespace")
    assert kube.list("Deployment", "team-b") == []  # not watched: left alone
    # Nothing was refused: told the scope (FLOWPREFILL_OPERATOR_WATCH_SCOPE), kopf does not
    # even ask for the namespace list or a CRD watch, which it would otherwise retry for
    # about a minute before falling back (docs/operator.md).
    assert emu.refused == set(), sorted(emu.refused, key=str)
    assert emu.checked > 10  # the operator's requests did go through the RBAC check
