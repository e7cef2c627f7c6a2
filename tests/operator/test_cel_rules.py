"""CRD rules a real API server evaluates, as table tests over their edge cases.

The rules are read from the generated CRDs (crds/*.yaml, found by their message), not
from the models, and evaluated with cel-python the way the API server does: an absent
field is absent (``has()`` is false, selecting it is an error), and a rule that fails to
evaluate refuses the object just as one that yields false. The rules these tables replaced
are kept as fixtures: run through the same tables they give the wrong answer on exactly
the cases the issue reported, so the tables can fail.

The ImageVolume gate cannot be a CRD rule (a CRD does not know the cluster's version); it
is the chart's ValidatingAdmissionPolicy, rendered per ``--kube-version`` and evaluated
here against ServingPools with and without ``spec.model.image``.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from typing import Any

import celpy
import pytest
from flowprefill_operator.models.modelsource import IMAGE_NEEDS_PATH

from tests.operator.chart import CHART, RELEASE_NAMESPACE, helm_binary, render
from tests.operator.crdcheck import load_crds, validate_cr

SELECTOR_MESSAGE = "In/NotIn need values; Exists/DoesNotExist take none"

# The rules as they were before the fix (the "CEL defects").
OLD_SELECTOR_RULE = (
    "self.operator in ['In', 'NotIn'] ? size(self.values) > 0 : size(self.values) == 0"
)
OLD_IMAGE_PATH_RULE = "!has(self.image) || self.path.startsWith(self.image.mountPath)"

ADMIT, REFUSE = "admit", "refuse"
ABSENT = object()  # a field left out of the object (not null, not empty)

_env = celpy.Environment()


def verdict(rule: str, **activation: Any) -> str:
    """What the API server answers: a rule that yields true admits; false, or an error
    (a missing field selected, as size(self.values) without values), refuses."""
    program = _env.program(_env.compile(rule))
    try:
        result = program.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})
    except celpy.CELEvalError:
        return REFUSE
    if isinstance(result, Exception):
        return REFUSE
    return ADMIT if bool(result) else REFUSE


def _nodes(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for name, sub in (node.get("properties") or {}).items():
            yield from _nodes(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            yield from _nodes(node["items"], f"{path}[]")


def crd_rule(message: str) -> tuple[str, dict[str, Any]]:
    """The one rule text carrying ``message`` in every CRD under crds/ (a rule reused by
    several fields must read the same everywhere), and a schema node it sits on."""
    found = {}
    for schema in load_crds().values():
        for path, node in _nodes(schema):
            for v in node.get("x-kubernetes-validations", []):
                if v["message"] == message:
                    found[path] = (v["rule"], node)
    assert found, f"no CRD rule with message {message!r}"
    rules = {rule for rule, _ in found.values()}
    assert len(rules) == 1, rules
    return next(iter(found.values()))


def pool_schema() -> dict[str, Any]:
    return next(s for (_, kind), s in load_crds().items() if kind == "ServingPool")


def model_schema(field: str) -> dict[str, Any]:
    model = pool_schema()["properties"]["spec"]["properties"]["model"]
    node: dict[str, Any] = model["properties"][field]
    return node


def pattern_admits(pattern: str, value: str) -> bool:
    # OpenAPI patterns are unanchored searches (the CRDs anchor theirs); Go's RE2 and
    # Python's re agree on these (no backreferences or lookarounds).
    return re.search(pattern, value) is not None


# ------------------------------------------------------------ matchExpressions entries

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
VALUES: dict[str, Any] = {"absent": ABSENT, "empty": [], "one": ["a"]}


def _selector_expected(op: str, values: str) -> str:
    # Kubernetes' LabelSelectorRequirement: In/NotIn need a non-empty values, Exists and
    # DoesNotExist take none (absent or empty, both as the API server serializes them).
    if op in ("In", "NotIn"):
        return ADMIT if values == "one" else REFUSE
    return REFUSE if values == "one" else ADMIT


SELECTOR_TABLE = [(op, v, _selector_expected(op, v)) for op in OPERATORS for v in VALUES]
# Where the old rule went wrong: size() of an absent values is an error, so Exists or
# DoesNotExist written the usual way (no values at all) was refused.
OLD_SELECTOR_WRONG = {("Exists", "absent"), ("DoesNotExist", "absent")}


def _requirement(op: str, values: str) -> dict[str, Any]:
    req: dict[str, Any] = {"key": "tier", "operator": op}
    if VALUES[values] is not ABSENT:
        req["values"] = VALUES[values]
    return req


@pytest.mark.parametrize(("op", "values", "expected"), SELECTOR_TABLE)
def test_selector_requirement_rule(op: str, values: str, expected: str) -> None:
    rule, node = crd_rule(SELECTOR_MESSAGE)
    assert set(node["properties"]["operator"]["enum"]) == set(OPERATORS)
    assert (
        "values" not in node.get("required", []) and "default" not in node["properties"]["values"]
    ), "the table assumes values may be absent on the wire"
    assert verdict(rule, self=_requirement(op, values)) == expected


def test_the_old_selector_rule_fails_the_table() -> None:
    wrong = {
        (op, v)
        for op, v, expected in SELECTOR_TABLE
        if verdict(OLD_SELECTOR_RULE, self=_requirement(op, v)) != expected
    }
    assert wrong == OLD_SELECTOR_WRONG


def test_an_exists_selector_passes_the_whole_crd() -> None:
    """End to end: a ServingPool whose sloClassSelector says ``operator: Exists`` the usual
    way (no values) is valid against the whole CRD (schema, defaults, every rule)."""
    pool: dict[str, Any] = {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "chat-prefill", "namespace": "team-a"},
        "spec": {
            "service": "chat",
            "role": "prefill",
            "model": {"path": "tiny-llama"},
            "sloClassSelector": {"matchExpressions": [{"key": "tier", "operator": "Exists"}]},
        },
    }
    schemas = load_crds()
    version = next(v for (v, kind) in schemas if kind == "ServingPool")
    pool["apiVersion"] = version
    assert validate_cr(pool, schemas) == []
    pool["spec"]["sloClassSelector"]["matchExpressions"][0]["operator"] = "In"
    assert validate_cr(pool, schemas) == [
        f".spec.sloClassSelector.matchExpressions[0]: {SELECTOR_MESSAGE}"
    ]


# ------------------------------------------------------------------ image path prefix

# (mountPath, path, expected): path must be the mount or lie under it, as a directory.
IMAGE_PATH_TABLE = [
    ("/models", "/models", ADMIT),
    ("/models", "/models/x", ADMIT),
    ("/models", "/models/x/y", ADMIT),
    ("/models", "/models-other/x", REFUSE),
    ("/models", "/modelsx", REFUSE),
    ("/models", "/m", REFUSE),
    ("/models", "/", REFUSE),
    ("/models", "/other/models", REFUSE),
    ("/models", None, REFUSE),  # with image, path is required
    ("/opt/m", "/opt/m/llama", ADMIT),
    ("/opt/m", "/opt/mx/llama", REFUSE),
]
# Where the old rule went wrong: a bare prefix admits siblings that share it.
OLD_IMAGE_PATH_WRONG = {
    ("/models", "/models-other/x"),
    ("/models", "/modelsx"),
    ("/opt/m", "/opt/mx/llama"),
}


def _model(mount: str, path: str | None) -> dict[str, Any]:
    model: dict[str, Any] = {"image": {"reference": "registry.example/llama@sha256:0"}}
    model["image"]["mountPath"] = mount
    if path is not None:
        model["path"] = path
    return model


@pytest.mark.parametrize(("mount", "path", "expected"), IMAGE_PATH_TABLE)
def test_image_path_rule(mount: str, path: str | None, expected: str) -> None:
    rule, _ = crd_rule(IMAGE_NEEDS_PATH)
    image = model_schema("image")["properties"]
    assert pattern_admits(image["mountPath"]["pattern"], mount), "a mountPath the CRD admits"
    if path is not None:
        assert pattern_admits(model_schema("path")["pattern"], path)
    assert verdict(rule, self=_model(mount, path)) == expected


def test_the_old_image_path_rule_fails_the_table() -> None:
    wrong = {
        (mount, path)
        for mount, path, expected in IMAGE_PATH_TABLE
        if verdict(OLD_IMAGE_PATH_RULE, self=_model(mount, path)) != expected
    }
    assert wrong == OLD_IMAGE_PATH_WRONG


@pytest.mark.parametrize(
    ("mount", "admitted"),
    [("/models", True), ("/", False), ("/opt/m", True), ("/models/", False), ("models", False),
     ("//models", False), ("/models//x", False), ("", False)],
)  # fmt: skip
def test_mount_path_pattern(mount: str, admitted: bool) -> None:
    """No trailing slash, no empty segment, not the root: the prefix rule appends the one
    '/' itself."""
    pattern = model_schema("image")["properties"]["mountPath"]["pattern"]
    assert pattern_admits(pattern, mount) is admitted


# ------------------------------------------------------------------------ model URIs

URI_TABLE = [
    ("hf://org/name", ADMIT),
    ("hf://name@rev", ADMIT),
    ("hf://name", ADMIT),
    ("hf://org/name@refs/pr/1", ADMIT),
    ("hf://meta-llama/Meta-Llama-3-8B-Instruct@5f0b02c", ADMIT),
    ("hf://a/b/c", REFUSE),  # a repo id is name or org/name
    ("hf://org/name@", REFUSE),
    ("hf://-org/name", REFUSE),
    ("hf://", REFUSE),
    ("pvc://claim", ADMIT),
    ("pvc://claim/", ADMIT),
    ("pvc://claim/sub/dir", ADMIT),
    ("pvc://claim/../x", REFUSE),  # the kubelet refuses a subPath leaving the volume
    ("pvc://claim/./x", REFUSE),
    ("pvc://claim/sub/..", REFUSE),
    ("pvc://Claim", REFUSE),  # claim names are DNS subdomains
    ("pvc://", REFUSE),
    ("s3://x", REFUSE),
    ("https://huggingface.co/org/name", REFUSE),
    (" hf://org/name", REFUSE),
]
URI_DOTS = [  # a revision of '.'/'..' segments would leave the cache directory
    ("hf://org/name@..", REFUSE),
    ("hf://org/name@../../x", REFUSE),
    ("hf://org/name@refs/../x", REFUSE),
    ("hf://org/name@v1.0", ADMIT),
]


@pytest.mark.parametrize("field", ["uri", "tokenizerUri"])
@pytest.mark.parametrize(("uri", "expected"), [*URI_TABLE, *URI_DOTS])
def test_uri_pattern(field: str, uri: str, expected: str) -> None:
    pattern = model_schema(field)["pattern"]
    assert (ADMIT if pattern_admits(pattern, uri) else REFUSE) == expected


# ------------------------------------------------- the chart's ImageVolume admission gate

POLICY = "ValidatingAdmissionPolicy"
BINDING = "ValidatingAdmissionPolicyBinding"


def gate(kube: str, *args: str) -> list[dict[str, Any]]:
    # Cluster scope unless args say otherwise (the chart's default is namespaced).
    docs = render("--kube-version", kube, "--set", "watch.scope=cluster", *args)
    return [d for d in docs if d["kind"] in (POLICY, BINDING)]


def _pool(image: bool) -> dict[str, Any]:
    model: dict[str, Any] = {"path": "/models/llama", "name": "llama"}
    if image:
        model["image"] = {"reference": "registry.example/llama@sha256:0", "mountPath": "/models"}
    return {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": "llama-prefill", "namespace": "team-a"},
        "spec": {"service": "llama", "role": "prefill", "model": model},
    }


def admission(policy: dict[str, Any], operation: str, new: bool, old: bool | None) -> str:
    """The policy's verdict on a CREATE or UPDATE of a pool with or without model.image
    (``oldObject`` is null on CREATE, as the API server binds it)."""
    verdicts = {
        verdict(
            v["expression"],
            object=_pool(new),
            oldObject=None if old is None else _pool(old),
            request={"operation": operation},
        )
        for v in policy["spec"]["validations"]
    }
    return REFUSE if REFUSE in verdicts else ADMIT


# (kube version, extra helm args, whether the policy is rendered)
GATE_CASES = [
    ("1.30.0", [], True),
    ("1.31.0", [], True),
    ("1.34.0", [], True),
    ("1.34.3", [], True),
    ("1.35.0", [], False),
    ("1.36.1", [], False),
    ("1.33.0", ["--set", "modelSources.imageVolumes=enabled"], False),
    ("1.35.0", ["--set", "modelSources.imageVolumes=disabled"], True),
    ("1.30.0", ["--set", "modelSources.imageVolumes=disabled"], True),
]


@pytest.mark.parametrize(("kube", "args", "rendered"), GATE_CASES)
def test_image_volume_gate_follows_the_kube_version(
    kube: str, args: list[str], rendered: bool
) -> None:
    docs = gate(kube, *args)
    if not rendered:
        assert docs == []
        return
    policy = next(d for d in docs if d["kind"] == POLICY)
    binding = next(d for d in docs if d["kind"] == BINDING)
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"]  # cluster scope: every namespace
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["flowprefill.io"] and rule["resources"] == ["servingpools"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE"}
    assert policy["spec"]["failurePolicy"] == "Fail"
    message = policy["spec"]["validations"][0]["message"]
    assert "ImageVolume" in message and "spec.model.image" in message
    if "imageVolumes=disabled" not in " ".join(args):
        assert "1.35" in message and f"v{kube}" in message

    assert admission(policy, "CREATE", new=True, old=None) == REFUSE
    assert admission(policy, "CREATE", new=False, old=None) == ADMIT
    assert admission(policy, "UPDATE", new=True, old=False) == REFUSE  # adding it
    assert admission(policy, "UPDATE", new=False, old=False) == ADMIT
    # A pool that already has it (created before the policy) can still be changed, and
    # deleted: kopf removes its finalizer with a patch, an UPDATE.
    assert admission(policy, "UPDATE", new=True, old=True) == ADMIT


def test_the_gate_with_scale_and_status_left_alone() -> None:
    """/scale and /status are other resources (servingpools/scale): the autoscaler and the
    operator's status patches never meet the policy."""
    (policy,) = [d for d in gate("1.30.0") if d["kind"] == POLICY]
    resources = policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"]
    assert not any("/" in r for r in resources)


def test_namespaced_gate_binds_only_the_watched_namespaces() -> None:
    docs = gate(
        "1.32.0", "--set", "watch.scope=namespaced", "--set", "watch.namespaces={team-a,team-b}"
    )
    binding = next(d for d in docs if d["kind"] == BINDING)
    selector = binding["spec"]["matchResources"]["namespaceSelector"]
    assert selector["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}
    ]
    other = gate("1.32.0", "--set", "watch.scope=namespaced", "-n", "elsewhere")
    assert {d["metadata"]["name"] for d in other} != {d["metadata"]["name"] for d in docs}, (
        "two releases' policies (cluster-scoped objects) must not share a name"
    )


def test_enabled_before_the_feature_existed_is_refused() -> None:
    out = subprocess.run(
        [str(helm_binary()), "template", "fp", str(CHART), "-n", RELEASE_NAMESPACE,
         "--kube-version", "1.30.0", "--set", "modelSources.imageVolumes=enabled"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0 and "ImageVolume" in out.stderr
