"""What a real API server does to an object on every write, for the emulator: quantity
canonicalisation, the defaults the operator's children get, Go's ``omitempty``, and the
messages of its 403/422 refusals.

The operator's apply compares its manifests with what the server stored; without this the
emulator would store exactly what was sent, and no test would see an operator that keeps
re-patching normalised objects (``1.5Gi`` stored as ``1536Mi``) or mistakes defaulted
fields for drift. Only the built-in kinds the operator writes are normalised; custom
resources are stored as sent (their CRD schema has no defaults the operator relies on).
"""

from __future__ import annotations

import copy
import re
from decimal import ROUND_CEILING, Decimal
from typing import Any

_BINARY = {"": 0, "Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {e: s for s, e in _DECIMAL.items()}
_BINARY_SUFFIX = {e: s for s, e in _BINARY.items()}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
_NANO = Decimal("1e-9")


def canonical_quantity(value: Any) -> Any:
    """A quantity as the API server stores it (apimachinery ``Quantity.String()`` after
    ``ParseQuantity``): the value keeps its format (binary ``Ki``..``Ei``, decimal
    ``n``..``E``, or exponent ``eN``) with the largest suffix that leaves an integer
    mantissa; a binary value below 1024 or with a fraction becomes decimal; precision is
    nano, rounded up. ``1.5Gi`` -> ``1536Mi``, ``1000m`` -> ``1``, ``0.5`` -> ``500m``,
    ``2000`` -> ``2k``, ``1.5Ki`` -> ``1536``. Anything else is returned as it is (the
    server's validation would refuse it)."""
    m = _QUANTITY.match(str(value).strip()) if isinstance(value, str | int) else None
    if m is None or isinstance(value, bool):
        return value
    number, suffix = Decimal(m[1]), m[2] or ""
    if suffix in _BINARY and suffix:
        fmt, amount = "binary", number * (1024 ** _BINARY[suffix])
    elif suffix[:1] in ("e", "E"):
        fmt, amount = "exponent", number.scaleb(int(suffix[1:]))
    else:
        fmt, amount = "decimal", number.scaleb(_DECIMAL[suffix])
    amount = amount.quantize(_NANO, rounding=ROUND_CEILING)
    if amount == 0:
        return "0"
    if fmt == "binary" and (abs(amount) < 1024 or amount != amount.to_integral_value()):
        fmt = "decimal"
    if fmt == "binary":
        n, e = int(amount), 0
        while e < 6 and n % 1024 == 0:
            n, e = n // 1024, e + 1
        return f"{n}{_BINARY_SUFFIX[e]}"
    n, e = int(amount.scaleb(9)), -9
    while e < 18 and n % 1000 == 0:
        n, e = n // 1000, e + 3
    if fmt == "exponent":
        return f"{n}e{e}" if e else str(n)
    return f"{n}{_DECIMAL_SUFFIX[e]}"


_QUANTITY_MAPS = {"requests", "limits", "hard", "capacity"}
_DROPPED_WHEN_EMPTY = {"labels", "annotations", "data", "binaryData", "nodeSelector"}
"""Go map fields tagged ``omitempty``: an empty map is not stored (nor is an empty list of
any field; structs such as ``emptyDir: {}`` are pointers and stay)."""


def _canonicalise(obj: Any, key: str = "", in_quantity_map: bool = False) -> Any:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            v = _canonicalise(v, k, k in _QUANTITY_MAPS and isinstance(v, dict))
            if (v == [] or (v == {} and k in _DROPPED_WHEN_EMPTY)) and k != "containers":
                continue  # omitempty
            out[k] = canonical_quantity(v) if in_quantity_map or k == "sizeLimit" else v
        return out
    if isinstance(obj, list):
        return [_canonicalise(v, key) for v in obj]
    return obj


def _image_pull_policy(image: str) -> str:
    # core/v1 SetDefaults_Container: Always for ":latest" or no tag, else IfNotPresent.
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return "IfNotPresent"
    tag = last.rsplit(":", 1)[1] if ":" in last else ""
    return "Always" if tag in ("", "latest") else "IfNotPresent"


def _probe_defaults(probe: dict[str, Any]) -> None:
    # core/v1 SetDefaults_Probe and SetDefaults_HTTPGetAction.
    for k, v in (("timeoutSeconds", 1), ("periodSeconds", 10), ("successThreshold", 1)):
        probe.setdefault(k, v)
    probe.setdefault("failureThreshold", 3)
    if "httpGet" in probe:
        probe["httpGet"].setdefault("scheme", "HTTP")


def _container_defaults(c: dict[str, Any]) -> None:
    # core/v1 SetDefaults_Container.
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    c.setdefault("imagePullPolicy", _image_pull_policy(str(c.get("image", ""))))
    for port in c.get("ports", []):
        port.setdefault("protocol", "TCP")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if isinstance(c.get(probe), dict):
            _probe_defaults(c[probe])


def _pod_spec_defaults(spec: dict[str, Any]) -> None:
    # core/v1 SetDefaults_PodSpec (and the volume sources' defaultMode 0644 = 420).
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("enableServiceLinks", True)
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        _container_defaults(c)
    for volume in spec.get("volumes", []):
        for source in ("configMap", "secret"):
            if isinstance(volume.get(source), dict):
                volume[source].setdefault("defaultMode", 420)


def _deployment_defaults(obj: dict[str, Any]) -> None:
    # apps/v1 SetDefaults_Deployment.
    spec = obj.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    strategy = spec.setdefault("strategy", {})
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        rolling = strategy.setdefault("rollingUpdate", {})
        rolling.setdefault("maxUnavailable", "25%")
        rolling.setdefault("maxSurge", "25%")
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)
    _pod_spec_defaults(spec.setdefault("template", {}).setdefault("spec", {}))


def _service_defaults(obj: dict[str, Any], previous: dict[str, Any] | None) -> None:
    # core/v1 SetDefaults_Service; clusterIP and ipFamilies are allocated by the registry
    # on create and kept on update.
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    for port in spec.get("ports", []):
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    old = (previous or {}).get("spec", {})
    spec.setdefault("clusterIP", old.get("clusterIP", "10.96.0.10"))
    spec.setdefault("clusterIPs", [spec["clusterIP"]])
    spec.setdefault("ipFamilies", ["IPv4"])
    spec.setdefault("ipFamilyPolicy", "SingleStack")


def normalise(plural: str, obj: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """``obj`` as the API server would store it (``previous``: the stored object on an
    update): defaults, then canonical quantities and omitempty; custom resources as sent."""
    out = copy.deepcopy(obj)
    if plural == "deployments":
        _deployment_defaults(out)
    elif plural == "pods":
        _pod_spec_defaults(out.setdefault("spec", {}))
    elif plural == "services":
        _service_defaults(out, previous)
    elif plural not in ("configmaps", "persistentvolumeclaims", "secrets"):
        return out
    result: dict[str, Any] = _canonicalise(out)
    return result


def refusal(status: int, plural: str, name: str, verb: str) -> tuple[str, str]:
    """Reason and message of a 403 or 422 as the API server words them."""
    if status == 403:
        return "Forbidden", (
            f'{plural} "{name}" is forbidden: User "system:serviceaccount:flowprefill:'
            f'flowprefill-operator" cannot {verb} resource "{plural}" in this namespace'
        )
    if status == 422:
        return "Invalid", f'{plural} "{name}" is invalid: spec: Invalid value: (forced by the test)'
    return "InternalError", f"{plural} {name!r}: forced error {status}"


def stale_version(
    plural: str, group: str, name: str, stored: dict[str, Any], body: Any
) -> str | None:
    """The message of the 409 Conflict the API server answers a write with whose body
    carries a ``metadata.resourceVersion`` other than the stored object's; None when it
    carries none or the current one. Optimistic concurrency (api-conventions.md,
    "Concurrency Control and Consistency"): a merge-patched object keeps the patch's
    version and the registry's update precondition compares it with the stored one, on
    /status and /scale too; so does a replace. (A JSON patch states the version in a
    ``test`` operation instead, checked where the patch is applied.)"""
    if not isinstance(body, dict):
        return None
    wanted = (body.get("metadata") or {}).get("resourceVersion")
    if wanted is None or str(wanted) == str(stored["metadata"].get("resourceVersion")):
        return None
    resource = f"{plural}.{group}" if group else plural
    return (
        f'Operation cannot be fulfilled on {resource} "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again"
    )


_REQ = re.compile(
    r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$"
)


def parse_selector(text: str) -> list[tuple[str, str, set[str]]]:
    """Label selector -> [(key, op, values)]; ops: =, !=, in, notin, exists, !exists."""
    reqs = []
    for part in re.split(r",(?![^()]*\))", text or ""):
        if not part.strip():
            continue
        m = _REQ.match(part)
        if not m:
            raise ValueError(f"bad label selector: {part!r}")
        neg, key, eq, value, setop, values = m.groups()
        if eq:
            reqs.append((key, "!=" if eq == "!=" else "=", {value}))
        elif setop:
            reqs.append((key, setop, {v.strip() for v in values.split(",") if v.strip()}))
        else:
            reqs.append((key, "!exists" if neg else "exists", set()))
    return reqs


def selector_matches(reqs: list[tuple[str, str, set[str]]], labels: dict[str, str]) -> bool:
    for key, op, values in reqs:
        present, value = key in labels, labels.get(key)
        ok = {
            "=": present and value in values,
            "!=": value not in values,
            "in": present and value in values,
            "notin": value not in values,
            "exists": present,
            "!exists": not present,
        }[op]
        if not ok:
            return False
    return True
