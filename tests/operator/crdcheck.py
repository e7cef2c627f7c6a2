"""Validate custom resources offline the way the API server would (approximately).

Structural-schema defaults are applied first, then the ``openAPIV3Schema`` is checked with
jsonschema (OpenAPI 3.0 = draft 4 semantics: boolean ``exclusiveMinimum``), then every
``x-kubernetes-validations`` CEL rule is evaluated with cel-python at its node, with
``oldSelf`` bound for transition rules when an old object is given (rules referring to
``oldSelf`` are skipped on create, as the API server does).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]


def load_crds(directory: Path = ROOT / "crds") -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema."""
    out = {}
    for path in sorted(directory.glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                out[key] = version["schema"]["openAPIV3Schema"]
    return out


def apply_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    if isinstance(obj, dict) and schema.get("type") == "object":
        for name, sub in schema.get("properties", {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                obj[name] = apply_defaults(obj[name], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in obj:
                obj[key] = apply_defaults(obj[key], extra)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in obj]
    return obj


_env = celpy.Environment()
_programs: dict[str, Any] = {}


def _eval(rule: str, self_value: Any, old_value: Any | None) -> bool:
    if rule not in _programs:
        _programs[rule] = _env.program(_env.compile(rule))
    activation = {"self": celpy.json_to_cel(self_value)}
    if old_value is not None:
        activation["oldSelf"] = celpy.json_to_cel(old_value)
    result = _programs[rule].evaluate(activation)
    if isinstance(result, Exception):
        raise result
    return bool(result)


def _cel_errors(obj: Any, old: Any | None, schema: dict[str, Any], path: str) -> list[str]:
    errors = []
    for v in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in v["rule"]
        if transition and old is None:
            continue
        try:
            ok = _eval(v["rule"], obj, old if transition else None)
        except Exception as e:
            errors.append(f"{path or '<root>'}: rule {v['rule']!r} failed to evaluate: {e}")
            continue
        if not ok:
            errors.append(f"{path or '<root>'}: {v['message']}")
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                old_sub = old.get(name) if isinstance(old, dict) else None
                errors += _cel_errors(obj[name], old_sub, sub, f"{path}.{name}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            # Transition rules on list items are not correlated here (none are used).
            errors += _cel_errors(item, None, schema["items"], f"{path}[{i}]")
    return errors


def validate_cr(
    obj: dict[str, Any],
    schemas: dict[tuple[str, str], dict[str, Any]],
    old: dict[str, Any] | None = None,
) -> list[str]:
    """Error messages for a custom resource (empty when the API server would accept it)."""
    schema = schemas.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if schema is None:
        return [f"no CRD for {obj.get('apiVersion')}/{obj.get('kind')}"]
    obj = apply_defaults(copy.deepcopy(obj), schema)
    old = apply_defaults(copy.deepcopy(old), schema) if old is not None else None
    validator = jsonschema.Draft4Validator(schema)
    errors = [
        f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)
    ]
    if errors:
        return errors
    return _cel_errors(obj, old, schema, "")
