"""``spec.colocated`` of a ``role: colocated`` ServingPool: the GPU memory split between
the prefill engine and vLLM decode in one pod, and decode-aware preemption between them
(docs/operator.md, "Colocated pools")."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from flowprefill.contracts.engine import DEFAULT_TBT_TARGET_S

from .common import CRModel, cel

MEMORY_SPLIT_OVER = (
    "colocated.decodeMemoryFraction + colocated.prefillMemoryFraction must not exceed 0.95 "
    "(the rest of the GPU holds the two processes' CUDA contexts and NCCL's buffers, which "
    "neither share counts)"
)
MAX_COLOCATED_MEMORY = 0.95


class DecodeAware(CRModel):
    """Decode-aware preemption in a colocated pod: the engine's ``decode_aware`` settings
    (:class:`flowprefill.contracts.engine.DecodeAwareSettings`; the beat socket is the
    pod's own, rendered by the operator)."""

    tbt_target_seconds: float = Field(
        default=DEFAULT_TBT_TARGET_S,
        gt=0,
        le=60,
        description="Time-between-tokens target the engine protects: that of the tightest "
        "class this pool decodes (the paper's §6.5: 0.1 s for chat and image, 0.2 s for "
        "search and file).",
    )
    rule: Literal["gap", "mean"] = Field(
        default="gap",
        description="gap: every time between tokens within the target; mean: each "
        "request's mean gap so far (the simulator's rule).",
    )


class ColocatedSettings(CRModel):
    """How a ``role: colocated`` pod splits its GPU(s) between the prefill engine and vLLM
    decode (docs/operator.md, "Colocated pools"). Both are fractions of each GPU's total
    memory, as vLLM's ``--gpu-memory-utilization`` is."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.decodeMemoryFraction + self.prefillMemoryFraction"
                    f" <= {MAX_COLOCATED_MEMORY}",
                    MEMORY_SPLIT_OVER,
                ),
            ]
        }
    )

    decode_memory_fraction: float = Field(
        default=0.45,
        gt=0,
        lt=1,
        description="vLLM's share of each GPU: its --gpu-memory-utilization (weights, "
        "activations and its KV cache fit in it; vLLM refuses to start when it cannot).",
    )
    prefill_memory_fraction: float = Field(
        default=0.45,
        gt=0,
        lt=1,
        description="The prefill engine's share of each GPU: the cap of its torch allocator "
        "(torch.cuda.set_per_process_memory_fraction in the engine's process; weights, "
        "activations, parked prefills and the NIXL buffer). Its tensor-parallel followers "
        "(engine.tpSize above 1) are not capped.",
    )
    decode_aware: DecodeAware | None = Field(
        default=None,
        description="Decode-aware preemption (docs/executor.md): vLLM sends its step beats "
        "to the engine, which parks a running prefill at an operator boundary while a "
        "decode step whose TBT target is at risk runs. Unset: off (prefill and decode "
        "share the device blindly).",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> ColocatedSettings:
        # The CRD's rule, in Python (the same double arithmetic as CEL's).
        if self.decode_memory_fraction + self.prefill_memory_fraction > MAX_COLOCATED_MEMORY:
            raise ValueError(MEMORY_SPLIT_OVER)
        return self
