"""CustomResourceDefinitions generated from the pydantic models.

The output goes to ``crds/`` (for ``kubectl apply``) and to the chart's
``charts/flowprefill/files/crds/``, which ``templates/crds.yaml`` renders (values ``crds.enabled``
and ``crds.keep``) so that ``helm upgrade`` upgrades them. The chart's own ``crds/`` directory
holds only kopf's static peering CRDs, which this module does not write.

Regenerate with ``python -m flowprefill_operator crdgen`` (from the repository root);
``--check`` exits non-zero when the files on disk are stale.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import JsonDict

from . import GROUP, VERSION
from .models import ServingPoolSpec, ServingPoolStatus, SLOClassSpec, SLOClassStatus
from .models.common import cel
from .models.gateway import ESCAPED_NAME_TOO_LONG, ESCAPED_POOL_NAME, MAX_ESCAPED_NAME

_DROP = {"title", "$defs"}
_ORDER = {"type": 0, "description": 1, "required": 2, "properties": 3}


@dataclass(frozen=True)
class ResourceKind:
    """Everything that defines one custom resource kind."""

    kind: str
    plural: str
    singular: str
    short_names: list[str]
    description: str
    spec: type[BaseModel]
    status: type[BaseModel]
    printer_columns: list[dict[str, Any]]
    scale: bool = False
    root_validations: list[JsonDict] = field(default_factory=list)

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


def _column(name: str, type_: str, path: str, description: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": type_, "jsonPath": path, "description": description, **extra}


_AGE = _column("Age", "date", ".metadata.creationTimestamp", "Time since creation.")

SLOCLASS = ResourceKind(
    kind="SLOClass",
    plural="sloclasses",
    singular="sloclass",
    short_names=["slo"],
    description="A latency tier: TTFT target, priority and the rules that assign requests to it.",
    spec=SLOClassSpec,
    status=SLOClassStatus,
    printer_columns=[
        _column("Task", "string", ".spec.taskType", "Task type."),
        _column("TTFT-ms", "integer", ".spec.ttftSloMs", "TTFT target (ms)."),
        _column("Priority", "integer", ".spec.priority", "Higher is more urgent."),
        _column("Default", "boolean", ".spec.default", "Catches unmatched requests."),
        _column("Attainment", "number", ".status.attainment", "Observed fraction meeting TTFT."),
        _column("Requests", "integer", ".status.requestCount", "Requests in the window."),
        _column("Shed", "integer", ".status.shedCount", "Requests refused (429) in the window."),
        _column("Accepted", "boolean", ".status.accepted", "In use as specified.", priority=1),
        _AGE,
    ],
)

SERVINGPOOL = ResourceKind(
    kind="ServingPool",
    plural="servingpools",
    singular="servingpool",
    short_names=["sp", "pool"],
    description="The replicas of one role (prefill, decode or both colocated) of a served model.",
    spec=ServingPoolSpec,
    status=ServingPoolStatus,
    printer_columns=[
        _column("Service", "string", ".spec.service", "Service (model) the pool belongs to."),
        _column("Role", "string", ".spec.role", "prefill, decode or colocated."),
        _column("Desired", "integer", ".spec.replicas", "Desired pods (spec.replicas)."),
        _column("Current", "integer", ".status.replicas", "Pods that exist."),
        _column("Ready", "integer", ".status.readyReplicas", "Ready pods."),
        _column("Owner", "string", ".spec.replicasOwner", "Who writes replicas.", priority=1),
        _column("Phase", "string", ".status.phase", "Summary of the conditions."),
        _column(
            "Last-Decision",
            "string",
            ".status.autoscaler.reason",
            "Why the autoscaler last decided what it did (replicasOwner operator).",
        ),
        _AGE,
    ],
    scale=True,
    root_validations=[
        cel(
            "size(self.metadata.name) <= 63"
            " && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
            "name must be a DNS-1035 label (it names the pool's Service)",
        ),
        cel(
            # Such a pool's Deployment and Service get a suffix (models.gateway).
            f"!self.metadata.name.matches('{ESCAPED_POOL_NAME.pattern}')"
            f" || size(self.metadata.name) <= {MAX_ESCAPED_NAME}",
            ESCAPED_NAME_TOO_LONG,
        ),
    ],
)

KINDS = (SLOCLASS, SERVINGPOOL)


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """Resolve ``$ref``s, collapse ``Optional`` and drop what a structural schema refuses."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"unions are not structural: {options}")
        if node.get("default", 0) is None:
            del node["default"]
        node = {**options[0], **node}
    ref = node.pop("$ref", None)
    if ref is None and len(node.get("allOf", [])) == 1:
        ref = node.pop("allOf")[0]["$ref"]
    if ref is not None:
        target = copy.deepcopy(defs[ref.rsplit("/", 1)[1]])
        target.update(node)  # the field's own description/default win over the model's
        node = target
    out: dict[str, Any] = {}
    for key in sorted(node, key=lambda k: (_ORDER.get(k, len(_ORDER)), k)):
        value = node[key]
        if key in _DROP or (key == "additionalProperties" and isinstance(value, bool)):
            continue  # extra="forbid" -> the API server prunes unknown fields instead
        if key == "properties":
            out[key] = {name: _inline(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _inline(value, defs)
    if "exclusiveMinimum" in out and not isinstance(out["exclusiveMinimum"], bool):
        out["minimum"], out["exclusiveMinimum"] = out["exclusiveMinimum"], True  # OpenAPI 3.0
    if "exclusiveMaximum" in out and not isinstance(out["exclusiveMaximum"], bool):
        out["maximum"], out["exclusiveMaximum"] = out["exclusiveMaximum"], True
    if isinstance(out.get("default"), dict):
        # Nested structs default to {} and the API server fills their own defaults in.
        out["default"] = {}
    if isinstance(out.get("default"), list) or ("additionalProperties" in out and "default" in out):
        del out["default"]  # omitted lists/maps already mean "empty"
    return out


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model as a structural OpenAPI v3 schema for a CRD."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema = _inline(raw, raw.get("$defs", {}))
    assert isinstance(schema, dict)
    return schema


def build_crd(rk: ResourceKind) -> dict[str, Any]:
    """The CustomResourceDefinition manifest of one kind."""
    root: dict[str, Any] = {
        "type": "object",
        "description": rk.description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "API version of the object."},
            "kind": {"type": "string", "description": "Kind of the object."},
            "metadata": {"type": "object", "description": "Standard object metadata."},
            "spec": openapi_schema(rk.spec),
            "status": openapi_schema(rk.status),
        },
    }
    if rk.root_validations:
        root["x-kubernetes-validations"] = rk.root_validations
    subresources: dict[str, Any] = {"status": {}}
    if rk.scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": rk.crd_name,
            "labels": {"app.kubernetes.io/part-of": "flowprefill"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": rk.kind,
                "listKind": f"{rk.kind}List",
                "plural": rk.plural,
                "singular": rk.singular,
                "shortNames": rk.short_names,
                "categories": ["flowprefill"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": subresources,
                    "additionalPrinterColumns": rk.printer_columns,
                }
            ],
        },
    }


CHART_CRDS = Path("charts/flowprefill/files/crds")
"""Where the chart reads the generated CRDs from (relative to the repository root)."""

HEADER = "# Generated by `python -m flowprefill_operator crdgen` from the pydantic models.\n"
HEADER += "# Do not edit by hand: edit operator/flowprefill_operator/models/ and regenerate.\n"


def render_crd(rk: ResourceKind) -> str:
    return HEADER + yaml.safe_dump(build_crd(rk), sort_keys=False, width=100)


def crd_files(root: Path) -> dict[Path, str]:
    """Every generated file (``crds/`` and the chart's ``files/crds/``) with its content."""
    files: dict[Path, str] = {}
    for rk in KINDS:
        text = render_crd(rk)
        for directory in (root / "crds", root / CHART_CRDS):
            files[directory / f"{rk.crd_name}.yaml"] = text
    return files


def stale_files(root: Path) -> list[Path]:
    """Generated files that are missing or differ from what the models produce."""
    return [
        path
        for path, text in crd_files(root).items()
        if not path.exists() or path.read_text() != text
    ]


def write_crds(root: Path) -> list[Path]:
    written = []
    for path, text in crd_files(root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
