"""The chart as platform teams consume cert-manager's, KubeRay's or KServe's, with the real
helm binary: as a subchart of an umbrella chart (``global`` values), the CRD lifecycle
values (``crds.enabled``, ``crds.keep``), namespaced RBAC by default and the users' roles
aggregated into the built-in view/edit/admin."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.chart import (
    CHART,
    RELEASE_NAMESPACE,
    helm_binary,
    is_hook,
    operator_roles,
    render,
)

Manifest = dict[str, Any]
AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"
KEEP = "helm.sh/resource-policy"


def _crds(docs: list[Manifest]) -> dict[str, Manifest]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}


# ------------------------------------------------------------------------------ subchart


def _umbrella(tmp_path: Path, values: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``helm template`` of an umbrella chart that depends on this one through file://
    (as a platform repository vendors it), with ``values`` as the umbrella's values."""
    umbrella = tmp_path / "platform"
    umbrella.mkdir()
    (umbrella / "Chart.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v2",
                "name": "platform",
                "version": "1.0.0",
                "dependencies": [
                    {"name": "flowprefill", "version": ">=0.0.0-0", "repository": f"file://{CHART}"}
                ],
            }
        )
    )
    (umbrella / "values.yaml").write_text(yaml.safe_dump(values))
    helm = str(helm_binary())
    built = subprocess.run(
        [helm, "dependency", "build", str(umbrella)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    return subprocess.run(
        [helm, "template", "platform", str(umbrella), "-n", RELEASE_NAMESPACE],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_chart_renders_as_a_subchart_with_global_values(tmp_path: Path) -> None:
    out = _umbrella(
        tmp_path,
        {
            # What umbrella charts and their other subcharts commonly share.
            "global": {"imageRegistry": "registry.example.com", "imagePullSecrets": ["regcred"]},
            "flowprefill": {"watch": {"namespaces": ["team-a"]}},
        },
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert "--namespace=team-a" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert set(_crds(docs)) == {"servingpools.flowprefill.io", "sloclasses.flowprefill.io"}


def test_a_typo_is_still_refused_under_the_umbrella(tmp_path: Path) -> None:
    out = _umbrella(tmp_path, {"global": {}, "flowprefill": {"replicaCont": 2}})
    assert out.returncode != 0 and "replicaCont" in out.stderr


def test_global_must_be_an_object() -> None:
    bad = subprocess.run(
        [str(helm_binary()), "template", "fp", str(CHART), "--set", "global=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "global" in bad.stderr


# --------------------------------------------------------------------------------- CRDs


def test_rendered_crds_are_what_crdgen_generates(repo_root: Path) -> None:
    """The chart renders the files crdgen writes for it (crd.CHART_CRDS; their freshness
    against the models: ``crdgen --check``, test_operator_models.py) unchanged but for
    Helm's labels and, with crds.keep (the default), the keep annotation: nothing is lost
    in the template's fromYaml/toYaml."""
    from flowprefill_operator.crd import CHART_CRDS, KINDS

    rendered = _crds(render())
    assert set(rendered) == {rk.crd_name for rk in KINDS}
    for rk in KINDS:
        generated = yaml.safe_load((repo_root / CHART_CRDS / f"{rk.crd_name}.yaml").read_text())
        doc = rendered[rk.crd_name]
        meta = doc.pop("metadata")
        assert meta["annotations"] == {KEEP: "keep"}
        assert meta["labels"].items() >= generated["metadata"]["labels"].items()
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert meta["name"] == generated.pop("metadata")["name"]
        assert doc == generated


def test_crds_enabled_false_renders_none() -> None:
    docs = render("--set", "crds.enabled=false")
    assert _crds(docs) == {}
    assert any(d["kind"] == "Deployment" for d in docs)


def test_crds_keep_false_lets_uninstall_delete_them() -> None:
    for crd in _crds(render("--set", "crds.keep=false")).values():
        assert KEEP not in crd["metadata"].get("annotations", {})


def test_only_kopfs_peering_crds_stay_in_crds_dir() -> None:
    """Helm installs crds/ once and never upgrades it: only kopf's static peering CRDs
    (which the chart's own KopfPeering objects need at install) may live there."""
    names = {
        d["metadata"]["name"]
        for path in (CHART / "crds").glob("*.yaml")
        for d in yaml.safe_load_all(path.read_text())
        if d
    }
    assert names == {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


# --------------------------------------------------------------------------------- RBAC


def test_default_install_is_namespaced() -> None:
    docs = render()
    dep = next(d for d in docs if d["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={RELEASE_NAMESPACE}" in args and "--all-namespaces" not in args
    roles = operator_roles(docs)
    assert [(r["kind"], r["metadata"]["namespace"]) for r in roles] == [("Role", RELEASE_NAMESPACE)]
    assert not [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    # No ClusterRole grants anything but flowprefill.io (Secrets, Deployments, ... never).
    for role in (d for d in docs if d["kind"] == "ClusterRole"):
        for rule in role["rules"]:
            assert rule["apiGroups"] == ["flowprefill.io"], (role["metadata"]["name"], rule)


def _user_roles(docs: list[Manifest]) -> dict[str, Manifest]:
    return {
        d["metadata"]["name"]: d
        for d in docs
        if d["kind"] == "ClusterRole"
        and any(k.startswith(AGGREGATE) for k in d["metadata"]["labels"])
    }


def _verbs(role: Manifest, resource: str) -> set[str]:
    return {
        v
        for r in role["rules"]
        if "flowprefill.io" in r["apiGroups"] and resource in r["resources"]
        for v in r["verbs"]
    }


@pytest.mark.parametrize("scope", ["namespaced", "cluster"])
def test_users_roles_aggregate_into_view_edit_admin(scope: str) -> None:
    roles = _user_roles(render("--set", f"watch.scope={scope}"))
    assert set(roles) == {"fp-flowprefill-view", "fp-flowprefill-edit"}
    view, edit = roles["fp-flowprefill-view"], roles["fp-flowprefill-edit"]
    aggregated = {
        name: {
            k.removeprefix(AGGREGATE)
            for k, v in r["metadata"]["labels"].items()
            if v == "true" and k.startswith(AGGREGATE)
        }
        for name, r in roles.items()
    }
    assert aggregated == {"fp-flowprefill-view": {"view"}, "fp-flowprefill-edit": {"edit", "admin"}}
    read = {"get", "list", "watch"}
    write = {"create", "update", "patch", "delete"}
    for kind in ("servingpools", "sloclasses"):
        assert _verbs(view, kind) == read
        assert _verbs(edit, kind) >= read | write
    assert _verbs(edit, "servingpools/scale") >= {"get", "patch", "update"}  # kubectl scale
    for role in (view, edit):  # nothing on status (the operator's) and nothing else
        assert not _verbs(role, "servingpools/status") & write
        assert all(r["apiGroups"] == ["flowprefill.io"] for r in role["rules"])
    named = render("--set", "fullnameOverride=team-b-fp")  # named after the release
    assert set(_user_roles(named)) == {"team-b-fp-view", "team-b-fp-edit"}


def test_users_roles_can_be_turned_off() -> None:
    assert _user_roles(render("--set", "rbac.aggregateToUserRoles=false")) == {}


# ------------------------------------------------------------------------ uninstall hook


def test_the_uninstall_hook_may_only_stop_the_operator() -> None:
    """The pre-delete hook (its effect: test_chart_uninstall.py) runs with its own
    ServiceAccount, whose Role may patch the operator's Deployment by name and list pods in
    the release namespace, nothing else (and, by a second Role, release the served pools'
    finalizer: test_chart_uninstall.py); its pod passes the restricted standard."""
    from tests.operator.test_chart_security import restricted_violations

    hooks = [d for d in render() if is_hook(d)]
    assert {d["kind"] for d in hooks} == {"ServiceAccount", "Role", "RoleBinding", "Job"}
    for doc in hooks:
        assert doc["metadata"]["namespace"] == RELEASE_NAMESPACE
        assert doc["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    (role,) = [
        d for d in hooks if d["kind"] == "Role" and d["metadata"]["name"] == "fp-flowprefill-stop"
    ]
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments"],
         "resourceNames": ["fp-flowprefill"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]  # fmt: skip
    (job,) = [d for d in hooks if d["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    (binding,) = [
        d
        for d in hooks
        if d["kind"] == "RoleBinding" and d["metadata"]["name"] == role["metadata"]["name"]
    ]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"] != "fp-flowprefill"
    assert restricted_violations(pod) == []
    assert pod["containers"][0]["command"] == ["python", "-m", "flowprefill_operator.stop"]
    assert not [d for d in render("--set", "uninstallHook.enabled=false") if is_hook(d)]


@pytest.mark.parametrize(("scope", "hint"), [("namespaced", True), ("cluster", False)])
def test_notes_say_which_namespaces_are_served(scope: str, hint: bool) -> None:
    out = subprocess.run(
        [str(helm_binary()), "install", "fp", str(CHART), "-n", RELEASE_NAMESPACE,
         "--dry-run=client", "--set", f"watch.scope={scope}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert ("elsewhere are not served" in notes) == hint


# ---------------------------------------------------------------- children's route default


def test_route_parent_refs_reach_the_operator_settings() -> None:
    """children.gatewayRouteParentRefs is read back through the operator's own settings
    model (FLOWPREFILL_OPERATOR_GATEWAY_ROUTE_PARENT_REFS, JSON); unset, no variable."""
    from flowprefill_operator.settings import OperatorSettings

    def env(*args: str) -> dict[str, str]:
        dep = next(d for d in render(*args) if d["kind"] == "Deployment")
        container = dep["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e["value"] for e in container["env"] if "value" in e}

    assert "FLOWPREFILL_OPERATOR_GATEWAY_ROUTE_PARENT_REFS" not in env()
    refs = env(
        "--set", "children.gatewayRouteParentRefs[0].name=public",
        "--set", "children.gatewayRouteParentRefs[0].namespace=gateways",
        "--set", "children.gatewayRouteParentRefs[0].sectionName=https",
    )  # fmt: skip
    (ref,) = OperatorSettings.from_env(refs).gateway_route_parent_refs
    assert (ref.name, ref.namespace, ref.section_name) == ("public", "gateways", "https")
    typo = subprocess.run(
        [str(helm_binary()), "template", "fp", str(CHART),
         "--set", "children.gatewayRouteParentRefs[0].nam=public"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert typo.returncode != 0
