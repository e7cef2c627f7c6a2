"""The parts of the OpenAI completions / chat completions request bodies the gateway uses.

Unknown fields are accepted and ignored (clients send many), but the fields we use are
validated with messages that name them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = Field(
        False, description="Send a last chunk with the usage and no choices (OpenAI semantics)."
    )


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="Model name, as listed by /v1/models.")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="Only n=1 is served.")
    slo_class: str | None = Field(None, max_length=128, description="FlowPrefill SLO class.")

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def output_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    def decode_sampling(self) -> dict[str, Any]:
        """Sampling fields forwarded to the decode instance as they were given."""
        keys = ("temperature", "top_p", "seed", "stop")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(description="Text, or a list of token ids.")

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # Content parts: only text is understood by a text-only model.
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
