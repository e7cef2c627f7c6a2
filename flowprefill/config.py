"""Settings of a prefill instance, as one pydantic model (also the engine.json the operator
writes into a ConfigMap). Every field has a description; names carry their units."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flowprefill.errors import InvalidRequestError
from flowprefill.scheduler.batching import BATCHING, batching_key
from flowprefill.scheduler.policies import POLICIES

Granularity = Literal["operator", "layer", "none"]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(
        "tiny-llama",
        description="A local Hugging Face model directory, or a built-in tiny model name "
        "(tiny-llama, tiny-qwen2, tiny-qwen3-moe, demo-llama).",
    )
    granularity: Granularity = Field(
        "operator", description="Where running prefills can be preempted."
    )
    chunk_size: int | None = Field(
        None,
        ge=16,
        description="Split prompts into chunks of this many tokens (None: no chunking).",
    )
    policy: str = Field("s-edf", description=f"Priority policy: {', '.join(POLICIES)}.")
    batching: str = Field("slo-aware", description=f"Batching policy: {', '.join(BATCHING)}.")
    batch_token_budget: int = Field(4096, ge=1, description="Most tokens in one batched prefill.")
    predictor_path: str | None = Field(
        None,
        description="TTFT profile JSON written by `flowprefill profile`; profiled at start "
        "when absent.",
    )
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda:0.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and activations dtype."
    )
    kernels: Literal["fast", "reference"] | None = Field(
        None,
        description="Executor kernels: fast (oneDNN linears on prepacked float32 CPU weights) "
        "or reference (the model's own modules); None: $FLOWPREFILL_KERNELS, else fast.",
    )
    tp_size: int = Field(1, ge=1, description="Tensor-parallel degree.")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (None: torch's default)."
    )

    def model_post_init(self, _: object) -> None:
        if self.policy.lower() not in POLICIES:
            raise InvalidRequestError(
                f"unknown scheduling policy {self.policy!r}; expected one of: "
                + ", ".join(sorted(POLICIES))
            )
        if batching_key(self.batching) not in BATCHING:
            raise InvalidRequestError(
                f"unknown batching policy {self.batching!r}; expected one of: "
                + ", ".join(sorted(BATCHING))
            )

    @classmethod
    def load(cls, path: str | Path) -> EngineConfig:
        p = Path(path)
        try:
            return cls.model_validate_json(p.read_text())
        except FileNotFoundError:
            raise InvalidRequestError(f"engine config {p} does not exist") from None
