"""spec.pod / spec.gatewayPod: the model and CRD refuse what collides with the operator's
pods, and apply_pod_overlay merges the rest onto a rendered pod by the documented rules."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from flowprefill_operator.builders.overlay import OverlayConflict, apply_pod_overlay
from flowprefill_operator.models import PodOverlay, ServingPoolSpec
from flowprefill_operator.models.podoverlay import RESERVED_VOLUMES
from pydantic import ValidationError

from tests.operator.crdcheck import validate_cr

K8S_VERSION = "1.33"


def operator_template() -> dict[str, Any]:
    """A pod template shaped as the builders render one (defaults that pass OpenShift's
    restricted-v2: no UIDs), with one main container and one init container."""
    hardened = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    return {
        "metadata": {
            "labels": {
                "app.kubernetes.io/managed-by": "flowprefill-operator",
                "flowprefill.io/pool": "m-prefill",
            },
            "annotations": {"flowprefill.io/config-hash": "abc"},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "imagePullSecrets": [{"name": "registry"}],
            "nodeSelector": {"gpu": "a100", "zone": "a"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "initContainers": [
                {
                    "name": "fetch",
                    "image": "ghcr.io/x/flowprefill:1",
                    "env": [{"name": "HOME", "value": "/tmp"}],
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                    "securityContext": copy.deepcopy(hardened),
                }
            ],
            "containers": [
                {
                    "name": "prefill",
                    "image": "ghcr.io/x/flowprefill:1",
                    "env": [
                        {"name": "HOME", "value": "/tmp"},
                        {"name": "HF_ENDPOINT", "value": "https://huggingface.co"},
                        {"name": "CACHE", "value": "$(HOME)/.cache"},
                    ],
                    "volumeMounts": [
                        {"name": "tmp", "mountPath": "/tmp"},
                        {"name": "dshm", "mountPath": "/dev/shm"},
                    ],
                    "securityContext": copy.deepcopy(hardened),
                }
            ],
            "volumes": [
                {"name": "tmp", "emptyDir": {}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        },
    }


FULL_OVERLAY: dict[str, Any] = {
    "labels": {"team": "search", "example.com/cost-center": "42"},
    "annotations": {"prometheus.io/scrape": "true"},
    "serviceAccountName": "llm-reader",
    "automountServiceAccountToken": True,
    "imagePullSecrets": [{"name": "mirror"}, {"name": "registry"}],
    "priorityClassName": "inference-high",
    "runtimeClassName": "nvidia",
    "schedulerName": "volcano",
    "nodeSelector": {"zone": "b", "pool": "gpu"},
    "tolerations": [{"key": "dedicated", "value": "llm", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                ]
            }
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"flowprefill.io/pool": "m-prefill"}},
                    },
                }
            ]
        },
    },
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"flowprefill.io/pool": "m-prefill"}},
            "minDomains": 2,
        }
    ],
    "securityContext": {
        "fsGroup": 2000,
        "fsGroupChangePolicy": "OnRootMismatch",
        "supplementalGroups": [3000],
        "seLinuxOptions": {"level": "s0:c123,c456"},
    },
    "containerSecurityContext": {
        "runAsGroup": 2000,
        "capabilities": {"add": ["NET_BIND_SERVICE"]},
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/llm.json"},
    },
    "env": [
        {"name": "HF_ENDPOINT", "value": "https://hf-mirror.internal"},
        {"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ],
    "envFrom": [{"configMapRef": {"name": "proxy-env"}, "prefix": "P_"}],
    "volumes": [
        {"name": "ca-bundle", "configMap": {"name": "corp-ca", "optional": False}},
        {"name": "models-extra", "persistentVolumeClaim": {"claimName": "lora", "readOnly": True}},
    ],
    "volumeMounts": [
        {"name": "ca-bundle", "mountPath": "/etc/ssl/corp", "readOnly": True},
        {"name": "models-extra", "mountPath": "/adapters", "subPath": "v1"},
    ],
}


def rendered(overlay: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    parsed = PodOverlay.model_validate(overlay) if overlay is not None else None
    return apply_pod_overlay(operator_template(), parsed, **kw)


def _containers(t: dict[str, Any]) -> list[dict[str, Any]]:
    return [*t["spec"]["containers"], *t["spec"]["initContainers"]]


def test_no_overlay_and_no_pull_secrets_leaves_the_template_as_rendered() -> None:
    assert rendered() == operator_template()
    assert rendered({}) == operator_template()


def test_rendered_pods_carry_pull_secrets_service_account_and_every_field_given() -> None:
    t = rendered(FULL_OVERLAY, pull_secrets=["org-wide", "registry"])
    meta, spec = t["metadata"], t["spec"]
    assert meta["labels"]["team"] == "search"
    assert meta["labels"]["example.com/cost-center"] == "42"
    assert meta["labels"]["flowprefill.io/pool"] == "m-prefill"  # the operator's kept
    assert meta["annotations"] == {
        "flowprefill.io/config-hash": "abc",
        "prometheus.io/scrape": "true",
    }
    # The template's, then the operator-wide ones, then the overlay's; one per name.
    assert spec["imagePullSecrets"] == [{"name": "registry"}, {"name": "org-wide"},
                                        {"name": "mirror"}]  # fmt: skip
    assert spec["serviceAccountName"] == "llm-reader"
    assert spec["automountServiceAccountToken"] is True
    assert spec["priorityClassName"] == "inference-high"
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["schedulerName"] == "volcano"
    assert spec["nodeSelector"] == {"gpu": "a100", "zone": "b", "pool": "gpu"}  # overlay wins
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists"},
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
    ]
    assert spec["affinity"] == FULL_OVERLAY["affinity"]
    assert spec["topologySpreadConstraints"] == FULL_OVERLAY["topologySpreadConstraints"]
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "fsGroup": 2000,
        "fsGroupChangePolicy": "OnRootMismatch",
        "supplementalGroups": [3000],
        "seLinuxOptions": {"level": "s0:c123,c456"},
    }
    for c in _containers(t):
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
            "runAsGroup": 2000,
            "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/llm.json"},
        }, c["name"]
        env = {e["name"]: e for e in c["env"]}
        assert env["HTTPS_PROXY"]["value"] == "http://proxy:3128"
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert c["envFrom"] == [{"configMapRef": {"name": "proxy-env"}, "prefix": "P_"}]
    assert [v["name"] for v in spec["volumes"]] == ["tmp", "dshm", "ca-bundle", "models-extra"]
    assert spec["volumes"][2] == FULL_OVERLAY["volumes"][0]
    assert spec["volumes"][3] == FULL_OVERLAY["volumes"][1]
    main = spec["containers"][0]
    assert main["volumeMounts"][2:] == FULL_OVERLAY["volumeMounts"]
    # Init containers get env, envFrom and the security context, not the mounts.
    assert spec["initContainers"][0]["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]


def test_user_env_replaces_the_operators_entry_in_place_and_appends_the_rest() -> None:
    t = rendered({"env": [{"name": "X", "value": "1"}, {"name": "HOME", "value": "/home/u"}]})
    main, init = t["spec"]["containers"][0], t["spec"]["initContainers"][0]
    assert main["env"] == [
        {"name": "HOME", "value": "/home/u"},  # where the operator's was: CACHE still sees it
        {"name": "HF_ENDPOINT", "value": "https://huggingface.co"},
        {"name": "CACHE", "value": "$(HOME)/.cache"},
        {"name": "X", "value": "1"},
    ]
    assert init["env"] == [{"name": "HOME", "value": "/home/u"}, {"name": "X", "value": "1"}]


def test_the_operators_labels_win_and_unset_scalars_keep_the_operators_defaults() -> None:
    # A template label the overlay cannot carry (reserved) is still the template's; a
    # plain key in both (the builders may add one later) stays the operator's.
    template = operator_template()
    template["metadata"]["labels"]["tier"] = "operator"
    t = apply_pod_overlay(template, PodOverlay.model_validate({"labels": {"tier": "user"}}))
    assert t["metadata"]["labels"]["tier"] == "operator"
    assert t["spec"]["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in t["spec"]


def test_the_merge_is_pure() -> None:
    template, overlay = operator_template(), PodOverlay.model_validate(FULL_OVERLAY)
    before = copy.deepcopy(template)
    first = apply_pod_overlay(template, overlay, pull_secrets=["a"])
    assert template == before
    assert apply_pod_overlay(template, overlay, pull_secrets=["a"]) == first
    # Containers do not share the overlay's lists (a later edit of one leaks nowhere).
    main, init = first["spec"]["containers"][0], first["spec"]["initContainers"][0]
    assert main["envFrom"] is not init["envFrom"]
    assert main["envFrom"][0] is not init["envFrom"][0]


@pytest.mark.parametrize(
    ("overlay", "message"),
    [
        ({"volumes": [{"name": "ca", "emptyDir": {}}],
          "volumeMounts": [{"name": "ca", "mountPath": "/tmp"}]}, "already mounts ['/tmp']"),
    ],
)  # fmt: skip
def test_a_mount_path_the_operator_uses_is_a_conflict(
    overlay: dict[str, Any], message: str
) -> None:
    with pytest.raises(OverlayConflict, match=message.replace("[", r"\[").replace("]", r"\]")):
        rendered(overlay)


def test_a_volume_name_the_template_already_has_is_a_conflict() -> None:
    # Not reserved by the CRD (the operator's list may grow before the CRD does).
    template = operator_template()
    template["spec"]["volumes"].append({"name": "ca", "emptyDir": {}})
    with pytest.raises(OverlayConflict, match="already name the operator's volumes"):
        apply_pod_overlay(
            template, PodOverlay.model_validate({"volumes": [{"name": "ca", "emptyDir": {}}]})
        )


def _deployment(template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "m-prefill", "namespace": "ns"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"flowprefill.io/pool": "m-prefill"}},
            "template": template,
        },
    }


def test_the_rendered_template_is_a_valid_kubernetes_pod_template() -> None:
    for overlay in (None, FULL_OVERLAY):
        t = rendered(overlay, pull_secrets=["org-wide"])
        kubernetes_validate.validate(_deployment(t), K8S_VERSION, strict=True)


def _pool(**spec: Any) -> dict[str, Any]:
    base = {"service": "m", "role": "prefill", "model": {"uri": "hf://org/model"}}
    return {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "m-prefill", "namespace": "ns"},
        "spec": {**base, **spec},
    }


def test_a_full_overlay_is_accepted_by_the_crd_and_the_model(crd_schemas: Any) -> None:
    obj = _pool(pod=FULL_OVERLAY, gatewayPod=FULL_OVERLAY)
    assert validate_cr(obj, crd_schemas) == []
    spec = ServingPoolSpec.model_validate(obj["spec"])
    assert spec.pod is not None and spec.gateway_pod is not None
    # Lossless round trip: what the operator merges is what the user wrote.
    assert spec.pod.wire() == {
        **FULL_OVERLAY,
        "tolerations": [{**FULL_OVERLAY["tolerations"][0], "operator": "Equal"}],
    }


def _with(**fields: Any) -> dict[str, Any]:
    return {**FULL_OVERLAY, **fields}


# (overlay, the message the API server would answer with)
BAD_OVERLAYS = [
    *(
        (_with(volumes=[{"name": n, "emptyDir": {}}], volumeMounts=[]), "volume names tmp, dshm")
        for n in RESERVED_VOLUMES
    ),
    (_with(labels={"flowprefill.io/pool": "x"}), "keys under flowprefill.io/"),
    (_with(labels={"app.kubernetes.io/name": "x"}), "keys under flowprefill.io/"),
    (_with(annotations={"flowprefill.io/config-hash": "x"}), "keys under flowprefill.io/"),
    (_with(labels={"team": "not a valid value"}), "labels.team"),
    (_with(volumeMounts=[{"name": "nope", "mountPath": "/x"}]), "must name one of this"),
    (
        _with(volumes=[], volumeMounts=[{"name": "ca-bundle", "mountPath": "/x"}]),
        "must name one of this",
    ),
    (_with(volumes=[{"name": "ca-bundle"}]), "volumes.0"),  # no source
    (_with(volumes=[{"name": "two", "emptyDir": {}, "secret": {"secretName": "s"}}]), "volumes.0"),
    (_with(volumes=[{"name": "Bad_Name", "emptyDir": {}}]), "volumes.0.name"),
    (_with(env=[{"name": "A"}]), "exactly one of value and valueFrom"),
    (
        _with(env=[{"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}]),
        "exactly one of value and valueFrom",
    ),
    (_with(env=[{"name": "1A=", "value": "1"}]), "env.0.name"),
    (_with(envFrom=[{"prefix": "X"}]), "exactly one of configMapRef and secretRef"),
    (
        _with(envFrom=[{"configMapRef": {"name": "a"}, "secretRef": {"name": "b"}}]),
        "exactly one of configMapRef and secretRef",
    ),
    (_with(securityContext={"seccompProfile": {"type": "Localhost"}}), "localhostProfile"),
    (
        _with(
            containerSecurityContext={
                "seccompProfile": {"type": "RuntimeDefault", "localhostProfile": "p"}
            }
        ),
        "localhostProfile",
    ),
    (_with(containerSecurityContext={"privileged": True}), "privileged"),
    (_with(securityContext={"runAsUser": -1}), "runAsUser"),
    (_with(topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "zone"}]), "whenUnsatisfiable"),
    (
        _with(
            topologySpreadConstraints=[
                {"maxSkew": 0, "topologyKey": "z", "whenUnsatisfiable": "DoNotSchedule"}
            ]
        ),
        "maxSkew",
    ),
    (_with(tolerations=[{"operator": "Maybe"}]), "tolerations.0.operator"),
    (_with(volumeMounts=[{"name": "ca-bundle", "mountPath": "relative"}]), "mountPath"),
    (
        _with(
            volumeMounts=[
                {"name": "ca-bundle", "mountPath": "/x", "mountPropagation": "Bidirectional"}
            ]
        ),
        "mountPropagation",
    ),
    (_with(imagePullSecrets=[{"name": f"s{i}"} for i in range(17)]), "imagePullSecrets"),
    (_with(nodeSelector={f"k{i}": "v" for i in range(33)}), "nodeSelector"),
]


@pytest.mark.parametrize(
    ("overlay", "message"), BAD_OVERLAYS, ids=[f"{i}-{m}" for i, (_, m) in enumerate(BAD_OVERLAYS)]
)
@pytest.mark.parametrize("field", ["pod", "gatewayPod"])
def test_bad_overlays_are_refused_by_the_crd_and_the_model(
    overlay: dict[str, Any], message: str, field: str, crd_schemas: Any
) -> None:
    obj = _pool(**{field: overlay})
    errors = validate_cr(obj, crd_schemas)
    if message != "privileged":  # the API server prunes unknown fields instead
        assert any(message in e for e in errors), errors
    with pytest.raises(ValidationError):
        ServingPoolSpec.model_validate(obj["spec"])


@pytest.mark.parametrize(
    "overlay",
    [
        {"labels": {"Bad Key": "x"}},
        {"labels": {"-x": "x"}},
        {"annotations": {"UPPER.example.com/x": "x"}},
        {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
        {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]},
        {"volumes": [{"name": "a", "emptyDir": "yes"}]},
        {"imagePullSecrets": [{"name": "a"}, {"name": "a"}]},
        {"env": [{"name": "A", "valueFrom": {"fieldRef": {}, "secretKeyRef": {}}}]},
    ],
)
def test_what_the_crd_leaves_to_list_map_keys_or_the_api_server_the_model_refuses(
    overlay: dict[str, Any],
) -> None:
    # Label-key syntax and list-map uniqueness are not the CEL's (cost, and crdcheck does
    # not model list-map keys): the operator's parser refuses them before any Deployment.
    with pytest.raises(ValidationError):
        PodOverlay.model_validate(overlay)


def test_the_crd_keeps_nested_kubernetes_objects_and_prunes_unknown_affinity_kinds(
    crd_schemas: Any,
) -> None:
    from tests.operator.crdcheck import ROOT, load_crds

    schema = load_crds(ROOT / "crds")[("flowprefill.io/v1alpha1", "ServingPool")]
    pod = schema["properties"]["spec"]["properties"]["pod"]["properties"]
    assert pod["affinity"].get("x-kubernetes-preserve-unknown-fields") is None  # pruned
    for kind in ("nodeAffinity", "podAffinity", "podAntiAffinity"):
        assert pod["affinity"]["properties"][kind]["x-kubernetes-preserve-unknown-fields"]
    assert pod["volumes"]["items"]["x-kubernetes-preserve-unknown-fields"]
    assert pod["topologySpreadConstraints"]["items"]["x-kubernetes-preserve-unknown-fields"]
    assert pod["env"]["items"]["properties"]["valueFrom"]["x-kubernetes-preserve-unknown-fields"]
    # Every list and map the CEL iterates is bounded (the API server's cost estimate).
    for name in ("labels", "annotations", "volumes", "volumeMounts"):
        assert "maxItems" in pod[name] or "maxProperties" in pod[name], name


def _doc_examples(repo_root: Path) -> list[dict[str, Any]]:
    text = (repo_root / "docs" / "pods.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    return [y["spec"] for b in blocks if (y := yaml.safe_load(b)) and "spec" in y]


def test_every_example_in_docs_pods_md_is_accepted(repo_root: Path, crd_schemas: Any) -> None:
    examples = _doc_examples(repo_root)
    assert len(examples) >= 6  # one per field group
    for spec in examples:
        obj = _pool(**spec)
        assert validate_cr(obj, crd_schemas) == [], spec
        pool = ServingPoolSpec.model_validate(obj["spec"])
        t = apply_pod_overlay(operator_template(), pool.pod, pull_secrets=["org-wide"])
        kubernetes_validate.validate(_deployment(t), K8S_VERSION, strict=True)
