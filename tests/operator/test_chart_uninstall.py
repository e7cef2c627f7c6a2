"""``helm uninstall`` before deleting the pools, as Helm does it: the operator's RBAC goes
in the same pass as its Deployment, without waiting for the pod to stop.

Against the RBAC-enforcing emulator of test_namespaced_rbac.py, with the chart's own
Role, the operator (``kopf run`` with the chart's arguments) and a stand-in for the
kubelet (it stops the operator process once its Deployment is scaled to 0, and then
deletes the pod object). Without the chart's pre-delete hook, the operator is asked to
exit after its Role is gone and cannot release kopf's finalizer: a pool deleted later
hangs in Terminating. With it (``python -m flowprefill_operator.stop``, run first, as Helm
runs pre-delete hooks), the operator exits while it may still patch the pools.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tests.operator.emulator as emulator_module
from tests.operator.chart import RELEASE_NAMESPACE, is_hook, operator_roles, render
from tests.operator.cluster import pool, slo
from tests.operator.emulator import EmulatorThread
from tests.operator.harness import free_port, kube_for, wait_for
from tests.operator.test_namespaced_rbac import OPERATOR_TOKEN, RBACEmulator, _kubeconfig

SERVED = "team-u"
FINALIZER = "flowprefill.io/finalizer"
DEPLOYMENT = "fp-flowprefill"


@dataclass
class Install:
    """The chart's objects as the emulator holds them, and the operator process."""

    emulator: RBACEmulator
    kube: Any  # the cluster admin's (Helm's) client
    proc: subprocess.Popen[bytes]
    log: Path
    docs: list[dict[str, Any]]
    admin_config: Path

    def kubelet(self) -> threading.Thread:
        """Once the operator's Deployment has 0 replicas, stop its process (SIGTERM, as
        the kubelet does) and delete the pod object when it has exited."""

        def run() -> None:
            wait_for(
                lambda: (
                    self.kube.get("Deployment", RELEASE_NAMESPACE, DEPLOYMENT)["spec"]["replicas"]
                    == 0
                ),
                60,
                "the operator scaled to 0",
            )
            self.stop_operator()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def stop_operator(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.kube.delete("Pod", RELEASE_NAMESPACE, "fp-flowprefill-0")

    def helm_deletes_the_release(self) -> None:
        """What ``helm uninstall`` deletes at once: the Deployment and the operator's RBAC
        (the emulator stops honouring the Role the moment it is deleted)."""
        self.kube.delete("Deployment", RELEASE_NAMESPACE, DEPLOYMENT)
        self.emulator.rules = {}

    def finalized_pools(self) -> list[str]:
        return [
            p["metadata"]["name"]
            for p in self.kube.list("ServingPool", SERVED)
            if FINALIZER in (p["metadata"].get("finalizers") or [])
        ]


@pytest.fixture
def install(tmp_path: Path, repo_root: Path) -> Iterator[Install]:
    docs = render(
        "--set", f"watch.namespaces={{{SERVED}}}", "--set", "modelSources.check=false",
    )  # fmt: skip
    dep = next(d for d in docs if d["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    port = free_port()
    args = [
        f"--liveness=http://127.0.0.1:{port}/healthz" if a.startswith("--liveness=") else a
        for a in container["args"]
    ]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["FLOWPREFILL_OPERATOR_RECONCILE_INTERVAL_S"] = "1"

    mp = pytest.MonkeyPatch()
    mp.setattr(emulator_module, "ClusterEmulator", RBACEmulator)
    emu = EmulatorThread(sorted((repo_root / "crds").glob("*.yaml"))).start()
    mp.undo()
    assert isinstance(emu.emulator, RBACEmulator)
    emu.emulator.rules = {d["metadata"]["namespace"]: d["rules"] for d in operator_roles(docs)}
    admin_config = _kubeconfig(emu, tmp_path / "admin.yaml", None)
    kube = kube_for(admin_config)
    # What Helm and the cluster hold for the release: the operator's Deployment and pod.
    selector = dep["spec"]["selector"]["matchLabels"]
    kube.create({**dep, "metadata": {**dep["metadata"], "namespace": RELEASE_NAMESPACE}})
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "fp-flowprefill-0", "namespace": RELEASE_NAMESPACE,
                         "labels": selector},
            "spec": {"containers": [{"name": "operator", "image": container["image"]}]},
        }
    )  # fmt: skip
    log_path = tmp_path / "operator.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", *container["command"], *args],
            env={
                **os.environ,
                **env,
                "KUBECONFIG": str(_kubeconfig(emu, tmp_path / "op.yaml", OPERATOR_TOKEN)),
                "POD_NAME": "fp-flowprefill-0",
            },
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    it = Install(emu.emulator, kube, proc, log_path, docs, admin_config)
    try:
        kube.create(
            {**slo("chat", 250, default=True), "metadata": {"name": "chat", "namespace": SERVED}}
        )
        for p in (pool("m-prefill", "m"), pool("m-decode", "m", role="decode")):
            kube.create({**p, "metadata": {**p["metadata"], "namespace": SERVED}})
        wait_for(
            lambda: len(it.finalized_pools()) == 2,
            60,
            "kopf's finalizer on both pools: " + log_path.read_text()[-2000:],
        )
        yield it
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        emu.stop()


def _hook_args(docs: list[dict[str, Any]]) -> list[str]:
    job = next(d for d in docs if d["kind"] == "Job" and is_hook(d))
    container = job["spec"]["template"]["spec"]["containers"][0]
    return [*container["command"][1:], *container["args"]]


def test_without_the_hook_uninstall_first_leaves_a_finalizer(install: Install) -> None:
    """The race the hook exists for: Helm removes the Role while the pod still runs."""
    install.helm_deletes_the_release()
    install.stop_operator()
    assert sorted(install.finalized_pools()) == ["m-decode", "m-prefill"]
    # Its exit tried to release them (reading the pool first, then patching): refused.
    refused = {(res, ns) for _, res, ns in install.emulator.refused}
    assert ("flowprefill.io/servingpools", SERVED) in refused, install.emulator.refused
    install.kube.delete("ServingPool", SERVED, "m-prefill")
    stuck = install.kube.get("ServingPool", SERVED, "m-prefill")
    assert stuck is not None and stuck["metadata"].get("deletionTimestamp")  # Terminating


def test_the_pre_delete_hook_stops_the_operator_before_its_rbac_goes(install: Install) -> None:
    kubelet = install.kubelet()
    # Helm runs the pre-delete hook first (here with the admin's credentials; the hook's
    # own Role is checked in test_chart_lifecycle.py), then deletes the release.
    hook = subprocess.run(
        [sys.executable, *_hook_args(install.docs)],
        env={**os.environ, "KUBECONFIG": str(install.admin_config)},
        capture_output=True,
        text=True,
        timeout=150,
    )
    kubelet.join(30)
    assert hook.returncode == 0 and "operator stopped" in hook.stdout, hook.stderr
    install.helm_deletes_the_release()
    assert install.finalized_pools() == [], install.log.read_text()[-3000:]
    for name in ("m-prefill", "m-decode"):
        install.kube.delete("ServingPool", SERVED, name)
    assert install.kube.list("ServingPool", SERVED) == []  # gone at once: none Terminating
    wait_for(lambda: install.kube.list("Deployment", SERVED) == [], 10, "children collected")


class _StuckKube:
    """An API where the operator's pod never goes (and, optionally, its Deployment is
    already gone)."""

    def __init__(self, deployment_gone: bool) -> None:
        self.deployment_gone = deployment_gone
        self.patches: list[dict[str, Any]] = []
        self.lists = 0

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        from flowprefill_operator.kube import ApiError

        if self.deployment_gone:
            raise ApiError(404, "NotFound", name)
        self.patches.append(patch)

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        self.lists += 1
        return [{"metadata": {"name": "fp-flowprefill-0", "labels": labels}}]


@pytest.mark.parametrize("deployment_gone", [False, True])
def test_the_hook_gives_up_without_blocking_the_uninstall(deployment_gone: bool) -> None:
    from flowprefill_operator.stop import parse_selector, stop_operator

    kube = _StuckKube(deployment_gone)
    ticks = iter(range(100))
    stopped = stop_operator(
        kube,  # type: ignore[arg-type]
        RELEASE_NAMESPACE,
        DEPLOYMENT,
        parse_selector("a=b,c=d"),
        timeout_s=5,
        poll_s=0,
        clock=lambda: float(next(ticks)),
    )
    assert stopped is False and kube.lists >= 5
    assert kube.patches == ([] if deployment_gone else [{"spec": {"replicas": 0}}])


# ------------------------------------------------- an operator that could not clean up


KEEP = "example.com/keep"  # another controller's finalizer: never the hook's to remove


def hook_grants(docs: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], list[Any]]:
    """The hook's rendered RBAC: Role rules by namespace, and ClusterRole rules (every
    namespace), of the roles bound to the hook Job's ServiceAccount."""
    job = next(d for d in docs if d["kind"] == "Job" and is_hook(d))
    account = job["spec"]["template"]["spec"]["serviceAccountName"]
    bound = {
        (b["roleRef"]["kind"], b["metadata"].get("namespace"), b["roleRef"]["name"])
        for b in docs
        if is_hook(b)
        and b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and [(s["name"], s["namespace"]) for s in b["subjects"]] == [(account, RELEASE_NAMESPACE)]
    }
    roles: dict[str, list[Any]] = {}
    cluster: list[Any] = []
    for d in docs:
        key = (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
        if d["kind"] == "Role" and key in bound:
            roles.setdefault(d["metadata"]["namespace"], []).extend(d["rules"])
        elif d["kind"] == "ClusterRole" and key in bound:
            cluster.extend(d["rules"])
    return roles, cluster


class ScopedRBACEmulator(RBACEmulator):
    """test_namespaced_rbac's emulator plus ClusterRoles: ``cluster_rules`` hold in every
    namespace and for cluster-wide requests, as a ClusterRoleBinding's do."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.cluster_rules: list[dict[str, Any]] = []

    def _permits(self, verb: str, group: str, resource: str, namespace: str | None) -> bool:
        return super()._permits(verb, group, resource, namespace) or any(
            group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
            for r in self.cluster_rules
        )


def run_hook(docs: list[dict[str, Any]], kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *_hook_args(docs)],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_after_a_killed_operator_the_hook_releases_the_finalizer(
    install: Install, tmp_path: Path
) -> None:
    """SIGKILL (an OOM kill, a node lost): no cleanup ran, the pools keep kopf's
    finalizer. The hook, with its own rendered RBAC, releases it once the pod is gone;
    another controller's finalizer stays; after ``helm uninstall`` the pools go at once."""
    install.proc.kill()
    install.proc.wait(30)
    install.kube.delete("Pod", RELEASE_NAMESPACE, "fp-flowprefill-0")  # the kubelet's part
    live = install.kube.get("ServingPool", SERVED, "m-prefill")
    assert live is not None
    install.kube.patch(
        "ServingPool", SERVED, "m-prefill",
        {"metadata": {"finalizers": [*live["metadata"]["finalizers"], KEEP]}},
    )  # fmt: skip
    assert sorted(install.finalized_pools()) == ["m-decode", "m-prefill"]

    roles, cluster = hook_grants(install.docs)
    assert cluster == []  # namespaced mode: Roles only
    install.emulator.rules = roles  # the operator is dead: its token is now the hook's
    install.emulator.refused.clear()
    hook = run_hook(install.docs, _kubeconfig_for(install, tmp_path))
    assert hook.returncode == 0, hook.stderr
    assert install.emulator.refused == set()
    install.helm_deletes_the_release()
    assert install.finalized_pools() == [], hook.stdout
    assert "operator stopped" in hook.stdout, hook.stdout
    assert f"namespace {SERVED}: released {FINALIZER} from 2 pools" in hook.stdout, hook.stdout
    kept = install.kube.get("ServingPool", SERVED, "m-prefill")
    assert kept is not None and kept["metadata"]["finalizers"] == [KEEP]
    for name in ("m-prefill", "m-decode"):
        install.kube.delete("ServingPool", SERVED, name)
    assert [p["metadata"]["name"] for p in install.kube.list("ServingPool", SERVED)] == [
        "m-prefill"
    ]  # Terminating for KEEP's controller alone, as it should
    install.kube.patch("ServingPool", SERVED, "m-prefill", {"metadata": {"finalizers": None}})
    assert install.kube.list("ServingPool", SERVED) == []


def _kubeconfig_for(install: Install, tmp_path: Path) -> Path:
    """A kubeconfig with the token the emulator holds against ``rules``."""
    import yaml

    config = yaml.safe_load(install.admin_config.read_text())
    config["users"][0]["user"] = {"token": OPERATOR_TOKEN}
    path = tmp_path / "hook.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


POOL_RULE = {"apiGroups": ["flowprefill.io"], "resources": ["servingpools"],
             "verbs": ["get", "list", "patch"]}  # fmt: skip
STOP_RULES = [
    {"apiGroups": ["apps"], "resources": ["deployments"],
     "resourceNames": [DEPLOYMENT], "verbs": ["patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
]  # fmt: skip


@pytest.mark.parametrize("scope", ["namespaced", "cluster"])
def test_the_hooks_rbac_releases_exactly_the_served_pools(
    scope: str, tmp_path: Path, repo_root: Path
) -> None:
    """The rendered hook, under its rendered RBAC and nothing else, releases the pools of
    the namespaces the operator served (namespaced: those listed; cluster: all) and is
    refused nothing. Here no operator runs at all (crashlooping, or its Deployment gone)."""
    docs = render(
        "--set", f"watch.scope={scope}", "--set", "watch.namespaces={team-a,team-b}",
        "--set", "modelSources.check=false",
    )  # fmt: skip
    roles, cluster = hook_grants(docs)
    (account,) = [d for d in docs if is_hook(d) and d["kind"] == "ServiceAccount"]
    for doc in docs:  # created before the Job (weight -10), deleted with it
        if is_hook(doc) and doc["kind"] != "Job":
            assert doc["metadata"]["annotations"] == account["metadata"]["annotations"]
    if scope == "namespaced":
        assert roles == {RELEASE_NAMESPACE: STOP_RULES, "team-a": [POOL_RULE],
                         "team-b": [POOL_RULE]}  # fmt: skip
        assert cluster == []
    else:
        assert (roles, cluster) == ({RELEASE_NAMESPACE: STOP_RULES}, [POOL_RULE])

    mp = pytest.MonkeyPatch()
    mp.setattr(emulator_module, "ClusterEmulator", ScopedRBACEmulator)
    emu = EmulatorThread(sorted((repo_root / "crds").glob("*.yaml"))).start()
    mp.undo()
    try:
        assert isinstance(emu.emulator, ScopedRBACEmulator)
        admin = kube_for(_kubeconfig(emu, tmp_path / "admin.yaml", None))
        for ns in ("team-a", "team-b", "elsewhere"):
            p = pool("m-prefill", "m")
            meta = {**p["metadata"], "namespace": ns, "finalizers": [FINALIZER, KEEP]}
            admin.create({**p, "metadata": meta})
        emu.emulator.rules, emu.emulator.cluster_rules = roles, cluster
        hook = run_hook(docs, _kubeconfig(emu, tmp_path / "hook.yaml", OPERATOR_TOKEN))
        assert hook.returncode == 0, hook.stderr
        assert emu.emulator.refused == set(), hook.stderr
        assert "operator stopped" in hook.stdout  # no Deployment, no pod: nothing to wait for
        released = {"team-a", "team-b"} | ({"elsewhere"} if scope == "cluster" else set())
        for ns in ("team-a", "team-b", "elsewhere"):
            live = admin.get("ServingPool", ns, "m-prefill")
            assert live is not None
            want = [KEEP] if ns in released else [FINALIZER, KEEP]
            assert live["metadata"]["finalizers"] == want, (ns, hook.stdout)
            if ns in released:
                line = f"namespace {ns}: released {FINALIZER} from 1 pools: m-prefill"
                assert line in hook.stdout, hook.stdout
        assert f"released {FINALIZER} from {len(released)} pools" in hook.stdout
    finally:
        emu.stop()


def test_an_operator_still_running_after_the_timeout_puts_it_back(install: Install) -> None:
    """The hook's timeout passes while the operator runs on (a pod that ignores SIGTERM,
    a kubelet that is not there): the hook still releases, says the operator was not
    confirmed stopped, and exits 0. The running operator puts its finalizer back (kopf
    adds it on the pool's next event), which is why the output says to check the pools."""
    args = [f"--timeout={2}" if a.startswith("--timeout=") else a for a in _hook_args(install.docs)]
    hook = subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "KUBECONFIG": str(install.admin_config)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert hook.returncode == 0, hook.stderr
    assert "operator not confirmed stopped" in hook.stdout, hook.stdout
    assert f"namespace {SERVED}: released {FINALIZER} from 2 pools" in hook.stdout, hook.stdout
    assert "check the pools" in hook.stdout
    wait_for(lambda: len(install.finalized_pools()) == 2, 30, "the running operator's finalizer")
