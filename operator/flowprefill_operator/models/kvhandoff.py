"""``spec.kvHandoff``: how each prompt's KV cache travels from the prefill pool to decode.

Three transports (``flowprefill.contracts.names.KVTransport``; the CRD spells ``shared_dir``
as ``sharedDir``):

* ``nixl``: stock vLLM decode (``NixlConnector``, ``kv_consumer``) pulls the KV from the
  prefill pod's registered memory over NIXL/UCX. No shared storage, no FlowPrefill code in
  decode. The default on pools that run on GPUs (:func:`resolve_transport`).
* ``http``: each prefill pod serves its hand-offs on its KV port; decode's
  FlowPrefillConnector pulls them. Needs nothing from the cluster but pod-to-pod TCP.
* ``sharedDir``: a ReadWriteMany PVC (``claimName``) in both pools.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from .common import QUANTITY, CRModel, cel

Transport = Literal["sharedDir", "http", "nixl"]

UCX_ENV_PREFIX = "UCX_"
UCX_TLS_ENV = "UCX_TLS"
UCX_NET_DEVICES_ENV = "UCX_NET_DEVICES"
UCX_ENV_NAMES = "ucx.env names must start with UCX_"
UCX_ENV_OWN_FIELDS = (
    "set UCX_TLS with ucx.transports and UCX_NET_DEVICES with ucx.netDevices, not in ucx.env"
)
CLAIM_RULE = "claimName is required with transport sharedDir and not used with http or nixl"
SIZE_LIMIT_RULE = "sizeLimit applies to transport http (the emptyDir)"
NIXL_RULE = "nixl (bufferMiB, blockSize, ucx, rdma, ipcLock) applies to transport nixl"
BUDGET_RULE = "budget applies to transports http and sharedDir (nixl's is nixl.bufferMiB)"
DEFAULT_BUDGET = "8Gi"
"""The engine's default ``kv.budget_mb`` (8,192 MiB) as a quantity."""
RDMA_EXTENDED = (
    "rdma.resources names extended resources (domain/name, e.g. rdma/ib), not cpu or memory"
)


class UCXSettings(CRModel):
    """UCX, the library NIXL moves the KV with: which transports and devices it may use."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"!has(self.env) || self.env.all(k, k.startsWith('{UCX_ENV_PREFIX}'))",
                    UCX_ENV_NAMES),
                cel(f"!has(self.env) || (!('{UCX_TLS_ENV}' in self.env)"
                    f" && !('{UCX_NET_DEVICES_ENV}' in self.env))", UCX_ENV_OWN_FIELDS),
            ]
        }
    )  # fmt: skip

    transports: list[Annotated[str, Field(max_length=32, pattern=r"^\^?[a-z0-9_]+$")]] = Field(
        default_factory=list,
        max_length=16,
        description="UCX_TLS, joined with commas (e.g. [rc, cuda_copy, cuda_ipc] over "
        "InfiniBand/RoCE, [tcp] without RDMA); empty: UCX's own choice.",
    )
    net_devices: list[Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]] = Field(
        default_factory=list,
        max_length=16,
        description="UCX_NET_DEVICES, joined with commas (e.g. [mlx5_0:1]); empty: all.",
    )
    env: dict[str, Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict,
        max_length=32,
        description="Further UCX_* variables of both roles' containers (e.g. UCX_IB_GID_INDEX).",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> UCXSettings:
        if any(not k.startswith(UCX_ENV_PREFIX) for k in self.env):
            raise ValueError(UCX_ENV_NAMES)
        if {UCX_TLS_ENV, UCX_NET_DEVICES_ENV} & set(self.env):
            raise ValueError(UCX_ENV_OWN_FIELDS)
        return self

    def container_env(self) -> dict[str, str]:
        """The UCX variables of a container, in a stable order."""
        env: dict[str, str] = {}
        if self.transports:
            env[UCX_TLS_ENV] = ",".join(self.transports)
        if self.net_devices:
            env[UCX_NET_DEVICES_ENV] = ",".join(self.net_devices)
        return env | dict(sorted(self.env.items()))


class RDMASettings(CRModel):
    """The RDMA devices NIXL's UCX needs on the node (a device plugin's resources)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!has(self.resources) || self.resources.all(k, k.contains('/'))",
                    RDMA_EXTENDED),
            ]
        }
    )  # fmt: skip

    resources: dict[str, Annotated[str, Field(max_length=64, pattern=QUANTITY)]] = Field(
        default_factory=dict,
        max_length=8,
        description="Extended resources per pod, requests and limits alike (e.g. "
        "{rdma/ib: '1'} or {nvidia.com/hostdev: '1'}).",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> RDMASettings:
        if any("/" not in k for k in self.resources):
            raise ValueError(RDMA_EXTENDED)
        return self


class NixlHandoff(CRModel):
    """The ``nixl`` transport's settings; the same in both pools of a service."""

    buffer_mib: int = Field(
        default=512,
        ge=1,
        le=1_048_576,
        alias="bufferMiB",
        description="Prefill: the registered KV buffer (MiB) holding prompts decode has not "
        "pulled yet (engine.json kv.nixl.buffer_mb), on the engine's device: GPU memory on "
        "cuda, the pod's memory on cpu.",
    )
    block_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Tokens per KV block, in prefill's engine.json and as decode's "
        "--block-size (they must agree); unset: 16 on GPU pools (vLLM's default), 128 on "
        "CPU pools (a multiple of 32 there).",
    )
    ucx: UCXSettings | None = Field(
        default=None, description="UCX transports, devices and further UCX_* variables."
    )
    rdma: RDMASettings | None = Field(default=None, description="RDMA devices per pod.")
    ipc_lock: bool | None = Field(
        default=None,
        description="Add the IPC_LOCK capability (memory registration for RDMA) to the "
        "container; unset: when rdma.resources is not empty. The Pod Security Standard "
        "'restricted' refuses it (docs/operator.md, KV transport).",
    )

    @property
    def wants_ipc_lock(self) -> bool:
        """Whether the container gets ``IPC_LOCK`` (explicit, else with RDMA resources)."""
        if self.ipc_lock is not None:
            return self.ipc_lock
        return bool(self.rdma and self.rdma.resources)


class KVHandoff(CRModel):
    """How each prompt's KV cache travels from the prefill pool to the decode pool.

    ``nixl``: stock vLLM decode pulls it from the prefill pod's registered memory over
    NIXL/UCX (``nixl`` block: buffer, block size, UCX, RDMA devices, IPC_LOCK). ``http``
    (no shared storage): each prefill pod keeps its hand-offs on its own ``emptyDir`` and
    serves them at ``GET /v1/kv/<id>`` on its KV port (8300); decode's FlowPrefillConnector
    pulls each into its own ``emptyDir`` and deletes the source after loading.
    ``sharedDir``: a ReadWriteMany PVC (``claimName``), the same claim in both pools.
    ``transport`` unset: ``sharedDir`` with a ``claimName``, else ``nixl`` with a ``nixl``
    block or on a GPU pool, else ``sharedDir`` (which then needs a claim). Both pools of a
    service must hand off the same way.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.transport) ? (self.transport == 'sharedDir') == "
                    "has(self.claimName) : true",
                    CLAIM_RULE,
                ),
                cel(
                    "(has(self.transport) && self.transport == 'http') || !has(self.sizeLimit)",
                    SIZE_LIMIT_RULE,
                ),
                cel(
                    "!has(self.nixl) || (has(self.transport) ? self.transport == 'nixl'"
                    " : !has(self.claimName))",
                    NIXL_RULE,
                ),
                cel(
                    "!has(self.budget) || !has(self.transport) || self.transport != 'nixl'",
                    BUDGET_RULE,
                ),
            ]
        }
    )

    transport: Transport | None = Field(
        default=None,
        description="nixl: stock vLLM decode pulls from prefill's memory over NIXL/UCX; "
        "http: decode pulls from the prefill pod that computed the KV (each pod's own "
        "emptyDir); sharedDir: a ReadWriteMany PVC in both pools. Unset: sharedDir with "
        "claimName, else nixl with a nixl block or on a GPU pool, else sharedDir.",
    )
    claim_name: str | None = Field(
        default=None, max_length=253, description="ReadWriteMany PVC (transport sharedDir)."
    )
    mount_path: str = Field(
        default="/var/lib/flowprefill/kv",
        pattern=r"^/",
        max_length=256,
        description="Where the hand-off directory is mounted in both roles (http, sharedDir).",
    )
    size_limit: str | None = Field(
        default=None,
        pattern=QUANTITY,
        max_length=64,
        description="sizeLimit of each pod's emptyDir (transport http); room for maxAgeSeconds "
        "of hand-offs (KV bytes per token x tokens per second).",
    )
    budget: str | None = Field(
        default=None,
        pattern=QUANTITY,
        max_length=64,
        description="The most hand-off files each prefill pod holds for decode (http, "
        "sharedDir); a prompt past it gets no hand-off and decode recomputes it. With http the "
        "emptyDir's sizeLimit (unless set) and each pod's ephemeral-storage request are sized "
        f"from it. Unset: 90 % of sizeLimit when set, else {DEFAULT_BUDGET}.",
    )
    max_age_seconds: int = Field(
        default=600,
        ge=10,
        le=86_400,
        description="Prefill deletes hand-offs older than this that no decode has claimed.",
    )
    nixl: NixlHandoff | None = Field(
        default=None, description="Settings of the nixl transport (defaults apply if unset)."
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> KVHandoff:
        if self.transport is not None and (self.transport == "sharedDir") != (
            self.claim_name is not None
        ):
            raise ValueError(CLAIM_RULE)
        if self.transport != "http" and self.size_limit is not None:
            raise ValueError(SIZE_LIMIT_RULE)
        if self.nixl is not None and (
            self.transport != "nixl" if self.transport else self.claim_name is not None
        ):
            raise ValueError(NIXL_RULE)
        if self.budget is not None and self.transport == "nixl":
            raise ValueError(BUDGET_RULE)
        return self

    def resolve_transport(self, *, on_gpu: bool) -> Transport:
        """The transport in effect (see the class's docstring for an unset one)."""
        if self.transport is not None:
            return self.transport
        if self.claim_name is not None:
            return "sharedDir"
        return "nixl" if self.nixl is not None or on_gpu else "sharedDir"


def nixl_cel(gpu: str) -> str:
    """CEL at the ServingPool spec: whether the pool's effective transport is ``nixl``
    (:meth:`KVHandoff.resolve_transport`), given ``gpu``, the CEL of "runs on GPUs"."""
    kv = "self.kvHandoff"
    return (
        f"(has({kv}) ? (has({kv}.transport) ? {kv}.transport == 'nixl'"
        f" : !has({kv}.claimName) && (has({kv}.nixl) || {gpu})) : {gpu})"
    )
