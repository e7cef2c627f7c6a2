"""ServingPool: the replicas of one role (prefill, decode, or both colocated in one pod) of
one served model."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from flowprefill.contracts.engine import DEFAULT_BATCH_TOKEN_BUDGET, MAX_TP_SIZE
from flowprefill.contracts.names import DType
from flowprefill.contracts.nixl import CPU_BLOCK_MULTIPLE, CPU_BLOCK_SIZE, GPU_BLOCK_SIZE

from .autoscaling import OPERATOR_NEEDS_AUTOSCALING, AutoscalerStatus, Autoscaling, ReplicasOwner
from .colocated import ColocatedSettings
from .common import DNS_LABEL, QUANTITY, Condition, CRModel, LabelSelector, cel
from .gateway import GatewaySpec
from .kvhandoff import KVHandoff, Transport
from .modelsource import ModelSource
from .podoverlay import PodOverlay, Toleration  # Toleration lives there (the overlay's too)
from .rollout import RolloutSpec
from .servingpool_rules import (
    COLOCATED_DEVICE,
    COLOCATED_MEMORY_ARG,
    COLOCATED_ONLY,
    DECODE_TP_REFUSED,
    ENGINE_ROLE_ONLY,
    GPU_MEMORY_ARG_PREFIXES,
    KV_TRANSPORT_NEEDED,
    NIXL_BLOCK_SIZE_ARG,
    NIXL_CPU_BLOCK_SIZE,
    PREFILL_TP_REFUSED,
    RDMA_NOT_GPU,
    SPEC_RULES,
    VLLM_ARGS_ROLE_ONLY,
    VLLM_ARGS_TP_REFUSED,
    VLLM_ROLE_ONLY,
    sets_block_size,
    sets_tensor_parallel,
)

MAX_GPUS_PER_POD = 16
"""Most GPUs one pod asks for (no common node has more)."""


Role = Literal["prefill", "decode", "colocated"]
Granularity = Literal["operator", "layer", "none"]
Policy = Literal["s-edf", "d-edf", "edf", "fcfs"]
Batching = Literal["slo-aware", "member-headroom", "none"]


class ConfigMapKeyRef(CRModel):
    """A key of a ConfigMap in the pool's namespace."""

    name: str = Field(max_length=253, description="ConfigMap name.")
    key: str = Field(
        default="profile.json", max_length=253, description="Key within the ConfigMap."
    )


class EngineSettings(CRModel):
    """Prefill engine settings, written to the engine's JSON config."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.chunkSize) || self.chunkSize <= self.batchTokenBudget",
                    "chunkSize must not exceed batchTokenBudget",
                ),
            ]
        }
    )

    granularity: Granularity = Field(
        default="operator", description="Preemption granularity: operator, layer or none."
    )
    batch_token_budget: int = Field(
        default=DEFAULT_BATCH_TOKEN_BUDGET,
        ge=1,
        le=1_048_576,
        description="Token budget of one prefill batch.",
    )
    chunk_size: int | None = Field(
        default=None,
        ge=16,
        le=1_048_576,
        description="Chunked-prefill size in tokens; unset = off.",
    )
    max_blocking_ms: float | None = Field(
        default=None,
        gt=0,
        le=10_000,
        description="Operators predicted to run longer than this between two preemption "
        "checkpoints are split at run time (operator granularity); unset = the device's "
        "default (none on cuda: measured slower there, docs/gpu.md; 100 on cpu).",
    )
    parked_memory: str | None = Field(
        default=None,
        pattern=QUANTITY,
        description="Budget for the activations and KV cache preempted prefills hold while "
        "parked, a quantity (e.g. 4Gi) per engine process; a preemption that would exceed it "
        "is declined and the urgent request waits. Unset = unbounded.",
    )
    operator_splitting: bool = Field(
        default=True,
        description="false: operators always run whole (blocking bounded by the longest "
        "operator only, as in the FlowPrefill paper).",
    )
    policy: Policy = Field(default="s-edf", description="Scheduling policy (s-edf is FlowPrefill).")
    batching: Batching = Field(
        default="slo-aware",
        description="Batching policy: slo-aware is FlowPrefill's Algorithm 1; member-headroom "
        "also keeps each member's own deadline; none runs one request at a time.",
    )
    ttft_profile: ConfigMapKeyRef | None = Field(
        default=None, description="ConfigMap key holding the fitted TTFT profile JSON."
    )
    tp_size: int = Field(
        default=1,
        ge=1,
        le=MAX_TP_SIZE,
        description=f"Tensor-parallel degree, 1 to {MAX_TP_SIZE}: ranks of the one engine "
        "instance each pod runs (the engine spawns them; with cuda one GPU each, so "
        "resources.gpusPerPod must be at least this).",
    )
    device: Literal["cuda", "cpu"] = Field(default="cuda", description="Device the engine runs on.")
    dtype: DType = Field(default=DType.BFLOAT16, description="Weights and activations dtype.")

    @model_validator(mode="after")
    def _mirror_cel(self) -> EngineSettings:
        if self.chunk_size is not None and self.chunk_size > self.batch_token_budget:
            raise ValueError("chunkSize must not exceed batchTokenBudget")
        return self


class PoolResources(CRModel):
    """What each pod of the pool needs and where it may run."""

    gpus_per_pod: int = Field(
        default=1,
        ge=0,
        le=MAX_GPUS_PER_POD,
        description="GPUs requested per pod (requests and limits); at least the pool's "
        "tensor-parallel degree on GPU.",
    )
    gpu_resource_name: str = Field(
        default="nvidia.com/gpu", max_length=253, description="Extended resource name of a GPU."
    )
    cpu: str | None = Field(default=None, pattern=QUANTITY, description="CPU request and limit.")
    memory: str | None = Field(
        default=None, pattern=QUANTITY, description="Memory request and limit."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods must land on."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Taints the pods tolerate."
    )
    shm_size: str | None = Field(
        default=None,
        pattern=QUANTITY,
        max_length=64,
        description="sizeLimit of the pod's memory-backed /dev/shm (counts against memory); "
        "unset: 1Gi per tensor-parallel rank when the pool runs more than one, else no limit.",
    )


class VLLMSettings(CRModel):
    """Decode (vLLM) settings the operator understands; the rest go in ``vllmArgs``."""

    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=MAX_GPUS_PER_POD,
        description="vLLM's --tensor-parallel-size: ranks of the one vLLM server each pod "
        "runs, one GPU each (resources.gpusPerPod must be at least this).",
    )


class ServingPoolSpec(CRModel):
    """Desired state of a serving pool."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": SPEC_RULES})

    service: str = Field(
        max_length=40,
        pattern=DNS_LABEL,
        description="Service name grouping the pools of one model; they share one gateway.",
    )
    role: Role = Field(
        description="prefill or decode (one pool per role), or colocated: each pod runs the "
        "prefill engine and vLLM decode on the same GPU(s), listed as both to the gateway "
        "(docs/operator.md, Colocated pools)."
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=1024,
        description="Pods in the pool; written through /scale by its owner (replicasOwner).",
    )
    replicas_owner: ReplicasOwner = Field(
        default="external",
        description="Who writes replicas: external (kubectl scale, an HPA, you; the operator "
        "only reads them) or operator (its autoscaler, per the autoscaling block).",
    )
    autoscaling: Autoscaling | None = Field(
        default=None,
        description="The operator's autoscaler (acts only with replicasOwner operator).",
    )
    model: ModelSource = Field(description="Model weights and served name.")
    image: str | None = Field(
        default=None, max_length=512, description="Container image; defaults to the operator's."
    )
    engine: EngineSettings | None = Field(
        default=None,
        description="Prefill engine settings (role=prefill or colocated; defaults apply if unset).",
    )
    kv_handoff: KVHandoff | None = Field(
        default=None,
        description="KV hand-off from prefill to decode (same in both pools); unset: nixl "
        "with its defaults on a pool that runs on GPUs, else none (decode recomputes the "
        "prompt).",
    )
    vllm: VLLMSettings | None = Field(
        default=None,
        description="Decode (vLLM) settings (role=decode or colocated; defaults apply if unset).",
    )
    vllm_args: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list,
        max_length=64,
        description="Extra vLLM server arguments (role=decode or colocated).",
    )
    colocated: ColocatedSettings | None = Field(
        default=None,
        description="role=colocated: the GPU memory split between the prefill engine and "
        "vLLM (defaults apply if unset; ignored on a pool without GPUs), and decode-aware "
        "preemption between them (off if unset).",
    )
    resources: PoolResources = Field(
        default=PoolResources(), description="GPUs, CPU, memory and placement per pod."
    )
    slo_class_selector: LabelSelector | None = Field(
        default=None,
        description="SLOClasses (same namespace) the service's gateway serves; unset = all.",
    )
    pod: PodOverlay | None = Field(
        default=None,
        description="Escape hatch onto this pool's pods: pull secrets, service account, "
        "placement, metadata, env, extra volumes, security contexts (docs/pods.md).",
    )
    rollout: RolloutSpec | None = Field(
        default=None,
        description="Update strategy and drain bound of the pool's pods; unset: no surge "
        "beyond the pool's GPUs (maxSurge 0, maxUnavailable 1) on GPU pools (docs/pods.md).",
    )
    gateway: GatewaySpec | None = Field(
        default=None,
        description="The service's gateway (replicas, HPA, HTTPRoute), read from one pool "
        "only, as gatewayPod is.",
    )
    gateway_pod: PodOverlay | None = Field(
        default=None,
        description="The same onto the service's gateway pods, read from one pool only: the "
        "one whose tokenizer the gateway uses (the service's first prefill pool by name); "
        "ignored on the service's other pools.",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> ServingPoolSpec:
        # The same rules as the CRD's CEL (SPEC_RULES, the API server's copy); the operator
        # re-checks so that an object admitted without them (old CRD, emulator) still fails
        # clearly.
        if self.role == "decode" and self.engine is not None:
            raise ValueError(ENGINE_ROLE_ONLY)
        if self.role == "prefill" and self.vllm_args:
            raise ValueError(VLLM_ARGS_ROLE_ONLY)
        if self.role == "prefill" and self.vllm is not None:
            raise ValueError(VLLM_ROLE_ONLY)
        if self.role != "colocated" and self.colocated is not None:
            raise ValueError(COLOCATED_ONLY)
        gpus = self.resources.gpus_per_pod
        if self.role == "colocated":
            if (self.engine_settings.device == "cuda") != (gpus > 0):
                raise ValueError(
                    f"{COLOCATED_DEVICE} (engine.device={self.engine_settings.device}, "
                    f"resources.gpusPerPod={gpus})"
                )
            if any(a.startswith(GPU_MEMORY_ARG_PREFIXES) for a in self.vllm_args):
                raise ValueError(COLOCATED_MEMORY_ARG)
        tp = self.prefill_tp_size
        if self.role != "decode" and self.engine_settings.device == "cuda" and tp > gpus:
            raise ValueError(
                f"{PREFILL_TP_REFUSED} (engine.tpSize={tp}, resources.gpusPerPod={gpus})"
            )
        tp = self.decode_tp_size
        if self.role != "prefill" and gpus and tp > gpus:
            raise ValueError(
                f"{DECODE_TP_REFUSED} (vllm.tensorParallelSize={tp}, resources.gpusPerPod={gpus})"
            )
        if any(sets_tensor_parallel(a) for a in self.vllm_args):
            raise ValueError(VLLM_ARGS_TP_REFUSED)
        if self.replicas_owner == "operator" and self.autoscaling is None:
            raise ValueError(OPERATOR_NEEDS_AUTOSCALING)
        kv = self.kv_handoff
        if kv and not (kv.transport or kv.claim_name or kv.nixl or self.on_gpu):
            raise ValueError(KV_TRANSPORT_NEEDED)
        rdma = kv.nixl.rdma if kv and kv.nixl else None
        if rdma and self.resources.gpu_resource_name in rdma.resources:
            raise ValueError(RDMA_NOT_GPU)
        if self.transport == "nixl":
            if any(sets_block_size(a) for a in self.vllm_args):
                raise ValueError(NIXL_BLOCK_SIZE_ARG)
            if not self.on_gpu and self.nixl_block_size % CPU_BLOCK_MULTIPLE:
                raise ValueError(NIXL_CPU_BLOCK_SIZE)
        return self

    @property
    def runs_prefill(self) -> bool:
        """Whether the pool's pods run the prefill engine (prefill, colocated)."""
        return self.role != "decode"

    @property
    def runs_decode(self) -> bool:
        """Whether the pool's pods run vLLM decode (decode, colocated)."""
        return self.role != "prefill"

    @property
    def on_gpu(self) -> bool:
        """Whether the pool runs on GPUs: a prefill engine on ``cuda``, a decode or
        colocated pool with ``resources.gpusPerPod`` above 0 (vLLM's CPU backend otherwise;
        a colocated pool's engine device agrees, by the CRD's rule)."""
        if self.role == "prefill":
            return self.engine_settings.device == "cuda"
        return self.resources.gpus_per_pod > 0

    @property
    def kv(self) -> KVHandoff | None:
        """The KV hand-off in effect, its transport resolved: ``kvHandoff`` as given, or
        ``nixl`` with its defaults on a GPU pool without one; None: no hand-off."""
        kv = self.kv_handoff
        if kv is None:
            return KVHandoff(transport="nixl") if self.on_gpu else None
        return kv.model_copy(update={"transport": kv.resolve_transport(on_gpu=self.on_gpu)})

    @property
    def transport(self) -> Transport | None:
        """The transport in effect (:attr:`kv`); None: no hand-off."""
        kv = self.kv
        return kv.transport if kv else None

    @property
    def nixl_block_size(self) -> int:
        """Tokens per KV block with the nixl transport: ``kvHandoff.nixl.blockSize``, else
        vLLM's GPU default (16) or the CPU pools' 128."""
        kv = self.kv
        if kv and kv.nixl and kv.nixl.block_size is not None:
            return kv.nixl.block_size
        return GPU_BLOCK_SIZE if self.on_gpu else CPU_BLOCK_SIZE

    @property
    def engine_settings(self) -> EngineSettings:
        """Engine settings with defaults (prefill pools may omit the block)."""
        return self.engine or EngineSettings()

    @property
    def vllm_settings(self) -> VLLMSettings:
        """vLLM settings with defaults (decode pools may omit the block)."""
        return self.vllm or VLLMSettings()

    @property
    def colocated_settings(self) -> ColocatedSettings:
        """The memory split with defaults (colocated pools may omit the block)."""
        return self.colocated or ColocatedSettings()

    @property
    def prefill_tp_size(self) -> int:
        """The prefill engine's tensor-parallel degree (``engine.tpSize``)."""
        return self.engine_settings.tp_size

    @property
    def decode_tp_size(self) -> int:
        """vLLM's tensor-parallel degree (``vllm.tensorParallelSize``)."""
        return self.vllm_settings.tensor_parallel_size

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks of the one instance each pod runs: ``engine.tpSize`` (prefill) or
        ``vllm.tensorParallelSize`` (decode); a colocated pod runs both instances, and this
        is the larger degree."""
        if self.role == "prefill":
            return self.prefill_tp_size
        if self.role == "decode":
            return self.decode_tp_size
        return max(self.prefill_tp_size, self.decode_tp_size)


class ServingPoolStatus(CRModel):
    """Observed state of a serving pool."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation the status describes."
    )
    replicas: int = Field(default=0, description="Pods that exist (for /scale).")
    ready_replicas: int = Field(default=0, description="Pods that pass readiness.")
    updated_replicas: int = Field(default=0, description="Pods running the current template.")
    selector: str = Field(default="", description="Label selector of the pods (for the HPA).")
    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Invalid"] = Field(
        default="Pending", description="Summary of the conditions."
    )
    gateway: str = Field(default="", description="In-cluster URL of the service's gateway.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded and UpdatePending (a new pod template of "
        "the operator's own waits its turn: docs/operations.md).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    autoscaler: AutoscalerStatus | None = Field(
        default=None,
        description="The operator's autoscaler (replicasOwner operator): last decision and "
        "scale times; written by the autoscaler only.",
    )
