"""Security contexts a pool's pods may be given (``spec.pod.securityContext`` and
``containerSecurityContext``): the subsets of Kubernetes' types that a restricted cluster
(Pod Security Standard ``restricted``, OpenShift's ``restricted-v2``) leaves to the user."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from .common import CRModel, cel

MAX_IDS = 32
LOCALHOST_PROFILE = "localhostProfile is required with type Localhost and only used with it"


class SeccompProfile(CRModel):
    """The seccomp profile of a pod or container."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("(self.type == 'Localhost') == has(self.localhostProfile)", LOCALHOST_PROFILE)
            ]
        }
    )

    type: Literal["RuntimeDefault", "Localhost", "Unconfined"] = Field(
        description="RuntimeDefault (the container runtime's), Localhost (a file on the node) "
        "or Unconfined."
    )
    localhost_profile: str | None = Field(
        default=None, max_length=1024, description="Profile path on the node (type Localhost)."
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> SeccompProfile:
        if (self.type == "Localhost") != (self.localhost_profile is not None):
            raise ValueError(LOCALHOST_PROFILE)
        return self


class SELinuxOptions(CRModel):
    """SELinux labels of a pod or container."""

    user: str | None = Field(default=None, max_length=253, description="SELinux user.")
    role: str | None = Field(default=None, max_length=253, description="SELinux role.")
    type: str | None = Field(default=None, max_length=253, description="SELinux type.")
    level: str | None = Field(default=None, max_length=253, description="SELinux level.")


class PodSecurityContext(CRModel):
    """The pod-level security settings the overlay may set (a subset of Kubernetes')."""

    run_as_user: int | None = Field(
        default=None, ge=0, description="UID of the containers' processes (leave unset on "
        "OpenShift: restricted-v2 assigns one from the namespace's range).",
    )  # fmt: skip
    run_as_group: int | None = Field(default=None, ge=0, description="GID of the processes.")
    run_as_non_root: bool | None = Field(
        default=None, description="Refuse to start a container whose user is root."
    )
    fs_group: int | None = Field(
        default=None, ge=0, description="Group that owns the pod's volumes (unset on OpenShift)."
    )
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] | None = Field(
        default=None, description="When volume ownership is changed to fsGroup."
    )
    supplemental_groups: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=MAX_IDS, description="Extra GIDs of the processes."
    )
    seccomp_profile: SeccompProfile | None = Field(default=None, description="Seccomp profile.")
    se_linux_options: SELinuxOptions | None = Field(default=None, description="SELinux labels.")


class Capabilities(CRModel):
    """Linux capabilities added to and dropped from a container."""

    add: list[Annotated[str, Field(max_length=64)]] | None = Field(
        default=None, max_length=MAX_IDS, description="Capabilities added (e.g. NET_BIND_SERVICE)."
    )
    drop: list[Annotated[str, Field(max_length=64)]] | None = Field(
        default=None, max_length=MAX_IDS, description="Capabilities dropped (default: ALL)."
    )


class ContainerSecurityContext(CRModel):
    """The container-level security settings the overlay may set (a subset of Kubernetes';
    no ``privileged``, ``procMount`` or ``appArmorProfile``)."""

    run_as_user: int | None = Field(default=None, ge=0, description="UID of the process.")
    run_as_group: int | None = Field(default=None, ge=0, description="GID of the process.")
    run_as_non_root: bool | None = Field(
        default=None, description="Refuse to start the container if its user is root."
    )
    allow_privilege_escalation: bool | None = Field(
        default=None, description="Whether a process may gain privileges (default false)."
    )
    read_only_root_filesystem: bool | None = Field(
        default=None, description="Whether the image's filesystem is read-only (default true)."
    )
    capabilities: Capabilities | None = Field(
        default=None, description="Capabilities; add and drop merge separately over the "
        "default (drop ALL).",
    )  # fmt: skip
    seccomp_profile: SeccompProfile | None = Field(default=None, description="Seccomp profile.")
    se_linux_options: SELinuxOptions | None = Field(default=None, description="SELinux labels.")
