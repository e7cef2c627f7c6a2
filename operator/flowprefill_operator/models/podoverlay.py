"""``spec.pod`` / ``spec.gatewayPod``: the escape hatch onto the pods the operator renders.

Explicit fields rather than a whole PodTemplateSpec: each is a part of the pod that the
operator never needs to own (placement, identity, metadata, extra env and volumes,
security contexts), so the CRD validates it and the merge onto the operator's pod has one
documented rule per field (``builders/overlay.py``; ``docs/pods.md``). Fields whose
content is Kubernetes' own nested API (affinity terms, ``valueFrom``, volume sources) are
kept as preserved objects: the API server validates them when the operator creates the
Deployment.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import JsonDict

from .common import DNS_LABEL, CRModel, cel
from .security import ContainerSecurityContext, PodSecurityContext

RESERVED_VOLUMES = (
    "tmp",
    "dshm",
    "model",
    "model-cache",
    "tokenizer",
    "kv",
    "engine",
    "profile",
    "config",
    "slo",
)
"""Names of the volumes the operator itself puts in its pods (whichever a pod needs)."""

RESERVED_KEY_PREFIXES = ("flowprefill.io/", "app.kubernetes.io/")
"""Label and annotation key prefixes the operator owns (its selectors and config hash)."""

MAX_LABELS = 64
MAX_PULL_SECRETS = 16
MAX_NODE_SELECTOR = 32
MAX_TOLERATIONS = 32
MAX_SPREAD = 8
MAX_ENV = 64
MAX_ENV_FROM = 16
MAX_VOLUMES = 32
MAX_MOUNTS = 32
"""List and map bounds: the CRD's CEL cost estimate needs every iterated list bounded."""

FREE_FORM: JsonDict = {"x-kubernetes-preserve-unknown-fields": True}

RESERVED_VOLUME_MESSAGE = (
    "volume names tmp, dshm, model, model-cache, tokenizer, kv, engine, profile, config and "
    "slo are the operator's"
)
RESERVED_KEY_MESSAGE = "keys under flowprefill.io/ and app.kubernetes.io/ are the operator's"
MOUNT_NEEDS_VOLUME = "every volumeMounts[].name must name one of this overlay's volumes"
ENV_VALUE_OR_FROM = "set exactly one of value and valueFrom"
ENV_FROM_ONE_REF = "set exactly one of configMapRef and secretRef"

_KEYS_CEL = " && ".join(f"!k.startsWith('{p}')" for p in RESERVED_KEY_PREFIXES)
_RESERVED_CEL = "[" + ", ".join(f"'{n}'" for n in RESERVED_VOLUMES) + "]"

LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


def check_qualified_name(key: str) -> str:
    """Kubernetes' label/annotation key syntax (``[prefix/]name``), or ``ValueError``.

    Not in the CRD (a regex over unbounded map keys is over CEL's cost budget): the
    operator's parser refuses such a pool, and the API server would refuse the Deployment.
    """
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        raise ValueError(f"{key!r}: the prefix must be a DNS subdomain")
    if len(name) > 63 or not _NAME_PART.match(name):
        raise ValueError(
            f"{key!r}: the name must be 63 characters or fewer, alphanumeric, '-', '_' or "
            "'.', starting and ending with an alphanumeric character"
        )
    return key


def _check_keys(keys: dict[str, str]) -> dict[str, str]:
    for key in keys:
        check_qualified_name(key)
        if key.startswith(RESERVED_KEY_PREFIXES):
            raise ValueError(f"{key!r}: {RESERVED_KEY_MESSAGE}")
    return keys


def _reserved_keys_rule() -> JsonDict:
    return {"x-kubernetes-validations": [cel(f"self.all(k, {_KEYS_CEL})", RESERVED_KEY_MESSAGE)]}


class Toleration(CRModel):
    """A Kubernetes toleration."""

    key: str | None = Field(default=None, max_length=317, description="Taint key.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Key/value relation.")
    value: str | None = Field(default=None, max_length=63, description="Taint value (Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; unset matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated."
    )


class LocalObjectReference(CRModel):
    """A named object in the pool's namespace (an image pull Secret)."""

    name: str = Field(max_length=253, description="Object name.")


class Affinity(CRModel):
    """Kubernetes' pod affinity: the three known keys, each passed through as given (the
    API server validates the terms when the operator creates the Deployment); other keys
    are pruned."""

    node_affinity: dict[str, Any] | None = Field(
        default=None, description="Node affinity (required/preferred node terms).",
        json_schema_extra=FREE_FORM,
    )  # fmt: skip
    pod_affinity: dict[str, Any] | None = Field(
        default=None, description="Co-location with other pods.", json_schema_extra=FREE_FORM
    )
    pod_anti_affinity: dict[str, Any] | None = Field(
        default=None, description="Spreading away from other pods.", json_schema_extra=FREE_FORM
    )


class TopologySpreadConstraint(CRModel):
    """A Kubernetes topology spread constraint: the required fields typed, the rest
    (labelSelector, minDomains, matchLabelKeys, node policies) passed through."""

    # extra="allow": fields this model does not name keep their wire names and values.
    model_config = ConfigDict(extra="allow", json_schema_extra=FREE_FORM)

    max_skew: int = Field(ge=1, description="Most the pod counts of two domains may differ by.")
    topology_key: str = Field(
        min_length=1, max_length=317, description="Node label whose values are the domains."
    )
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        description="What the scheduler does when the skew cannot be kept."
    )


class EnvVar(CRModel):
    """One environment variable: a literal value or a reference (``valueFrom``)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.value) != has(self.valueFrom)", ENV_VALUE_OR_FROM)
            ]
        }
    )

    name: str = Field(
        max_length=256, pattern=ENV_NAME, description="Variable name (wins over the operator's)."
    )
    value: str | None = Field(default=None, max_length=32_768, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="Kubernetes' EnvVarSource: one of fieldRef, resourceFieldRef, "
        "configMapKeyRef, secretKeyRef.",
        json_schema_extra={**FREE_FORM, "minProperties": 1, "maxProperties": 1},
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> EnvVar:
        if (self.value is None) == (self.value_from is None):
            raise ValueError(ENV_VALUE_OR_FROM)
        if self.value_from is not None and len(self.value_from) != 1:
            raise ValueError("valueFrom takes exactly one source")
        return self


class EnvFromRef(CRModel):
    """A ConfigMap or Secret whose keys become environment variables."""

    name: str = Field(max_length=253, description="Object name (the pool's namespace).")
    optional: bool | None = Field(default=None, description="Start the pod if it is missing.")


class EnvFromSource(CRModel):
    """All keys of one ConfigMap or Secret as environment variables."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.configMapRef) != has(self.secretRef)", ENV_FROM_ONE_REF)
            ]
        }
    )

    config_map_ref: EnvFromRef | None = Field(default=None, description="The ConfigMap.")
    secret_ref: EnvFromRef | None = Field(default=None, description="The Secret.")
    prefix: str | None = Field(
        default=None, max_length=253, description="Prepended to every variable name."
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> EnvFromSource:
        if (self.config_map_ref is None) == (self.secret_ref is None):
            raise ValueError(ENV_FROM_ONE_REF)
        return self


class Volume(CRModel):
    """An extra pod volume: ``name`` plus exactly one Kubernetes volume source (configMap,
    secret, persistentVolumeClaim, csi, projected, ephemeral, ...), passed through as given
    (the API server validates the source when the operator creates the Deployment)."""

    # minProperties = maxProperties = 2: the name and one source, enforced by the schema
    # (CEL cannot see a preserved object's undeclared fields).
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            **FREE_FORM,
            "minProperties": 2,
            "maxProperties": 2,
            "x-kubernetes-validations": [
                cel(f"!(self.name in {_RESERVED_CEL})", RESERVED_VOLUME_MESSAGE)
            ],
        },
    )

    name: str = Field(
        max_length=63, pattern=DNS_LABEL, description="Volume name (unique in the pod)."
    )

    @model_validator(mode="after")
    def _check(self) -> Volume:
        if self.name in RESERVED_VOLUMES:
            raise ValueError(f"{self.name!r}: {RESERVED_VOLUME_MESSAGE}")
        sources = self.model_extra or {}
        if len(sources) != 1 or not all(isinstance(v, dict) for v in sources.values()):
            raise ValueError(
                f"volume {self.name!r} needs exactly one volume source (an object), got "
                f"{sorted(sources)}"
            )
        return self


class VolumeMount(CRModel):
    """Where a container mounts one of the overlay's volumes."""

    name: str = Field(max_length=63, pattern=DNS_LABEL, description="A volume of this overlay.")
    mount_path: str = Field(
        max_length=1024,
        pattern=r"^/",
        description="Absolute path in the container (unique among its mounts).",
    )
    sub_path: str | None = Field(
        default=None,
        max_length=1024,
        pattern=r"^[^/]",
        description="Path within the volume to mount instead of its root.",
    )
    read_only: bool | None = Field(default=None, description="Mount read-only.")
    mount_propagation: Literal["None", "HostToContainer"] | None = Field(
        default=None,
        description="None or HostToContainer (Bidirectional needs a privileged container).",
    )


def _map_list(key: str) -> JsonDict:
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]}


class PodOverlay(CRModel):
    """What the operator's pods take from the user: merged onto the pod the operator
    renders (``builders.overlay.apply_pod_overlay``; rules in ``docs/pods.md``)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes)"
                    " && self.volumes.exists(v, v.name == m.name))",
                    MOUNT_NEEDS_VOLUME,
                )
            ]
        }
    )

    labels: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]] = Field(
        default_factory=dict,
        max_length=MAX_LABELS,
        description="Extra pod labels (keys under flowprefill.io/ and app.kubernetes.io/ are "
        "the operator's).",
        json_schema_extra=_reserved_keys_rule(),
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_LABELS,
        description="Extra pod annotations (keys under flowprefill.io/ and app.kubernetes.io/ "
        "are the operator's).",
        json_schema_extra=_reserved_keys_rule(),
    )
    service_account_name: str | None = Field(
        default=None,
        max_length=253,
        description="ServiceAccount the pods run as; unset = the namespace's default.",
    )
    automount_service_account_token: bool | None = Field(
        default=None,
        description="Mount the ServiceAccount's API token; unset = false (the pods call no "
        "Kubernetes API). IRSA and Workload Identity usually want true.",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=MAX_PULL_SECRETS,
        description="Secrets to pull the images with, after the operator-wide ones.",
        json_schema_extra=_map_list("name"),
    )
    priority_class_name: str | None = Field(
        default=None, max_length=253, description="PriorityClass of the pods."
    )
    runtime_class_name: str | None = Field(
        default=None,
        max_length=253,
        description="RuntimeClass of the pods (e.g. nvidia on k3s/RKE2 for the GPU runtime).",
    )
    scheduler_name: str | None = Field(
        default=None, max_length=253, description="Scheduler of the pods; unset = the default."
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        max_length=MAX_NODE_SELECTOR,
        description="Node labels the pods must land on (merged over resources.nodeSelector; "
        "these win per key).",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=MAX_TOLERATIONS,
        description="Taints the pods tolerate, after resources.tolerations.",
    )
    affinity: Affinity | None = Field(
        default=None, description="Node affinity, pod affinity and pod anti-affinity."
    )
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list,
        max_length=MAX_SPREAD,
        description="How the pods spread across zones or nodes.",
    )
    security_context: PodSecurityContext | None = Field(
        default=None,
        description="Merged key by key over the operator's pod securityContext "
        "(runAsNonRoot, seccompProfile RuntimeDefault).",
    )
    container_security_context: ContainerSecurityContext | None = Field(
        default=None,
        description="Merged key by key over every container's securityContext (no privilege "
        "escalation, read-only root filesystem, drop ALL capabilities).",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_ENV,
        description="Environment of every container and init container; an entry named as "
        "one of the operator's replaces it.",
        json_schema_extra=_map_list("name"),
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list,
        max_length=MAX_ENV_FROM,
        description="ConfigMaps and Secrets whose keys become environment variables of "
        "every container and init container.",
    )
    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=MAX_VOLUMES,
        description="Extra pod volumes (names of the operator's own are refused).",
        json_schema_extra=_map_list("name"),
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=MAX_MOUNTS,
        description="Mounts of this overlay's volumes in the main container(s).",
        json_schema_extra=_map_list("mountPath"),
    )

    @field_validator("labels", "annotations")
    @classmethod
    def _keys(cls, keys: dict[str, str]) -> dict[str, str]:
        return _check_keys(keys)

    @model_validator(mode="after")
    def _mirror_cel(self) -> PodOverlay:
        # The CRD's rules (and its list-map uniqueness), for objects admitted without them.
        for what, names in (
            ("imagePullSecrets", [s.name for s in self.image_pull_secrets]),
            ("env", [e.name for e in self.env]),
            ("volumes", [v.name for v in self.volumes]),
            ("volumeMounts mountPath", [m.mount_path for m in self.volume_mounts]),
        ):
            if dupes := sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(f"{what}: duplicate entries {dupes}")
        volumes = {v.name for v in self.volumes}
        if missing := sorted({m.name for m in self.volume_mounts} - volumes):
            raise ValueError(f"{MOUNT_NEEDS_VOLUME} (unknown: {missing})")
        return self
