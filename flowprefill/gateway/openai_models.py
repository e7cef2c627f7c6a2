"""The OpenAI completions / chat completions request bodies (with vLLM's extra fields), and
vLLM's ``/tokenize`` / ``/detokenize`` bodies.

The fields the gateway itself serves are declared here and validated with messages that
name them; every other field a body carries is judged by
:func:`flowprefill.gateway.openai_fields.check_extra_fields` (passed to decode, accepted
with no effect, or refused naming the field) — :meth:`SamplingFields.refusals`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flowprefill.gateway.openai_fields import PASSED_TO_DECODE, check_extra_fields


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = Field(
        False, description="Send a last chunk with the usage and no choices (OpenAI semantics)."
    )
    continuous_usage_stats: bool | None = Field(
        False, description="vLLM's usage in every chunk: refused (not served)."
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
    priority: int = Field(
        0,
        ge=-(2**63),
        le=2**63 - 1,
        description="vLLM's: lower is handled earlier; mapped to the nearest SLO class the "
        "client may claim (flowprefill.gateway.slo_request), not sent to decode.",
    )
    ignore_eos: bool = Field(
        False,
        description="vLLM's: generate past end-of-sequence, up to max_tokens (benchmarks "
        "such as `vllm bench serve` send it for exact output lengths).",
    )

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def output_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    def refusals(self) -> list[tuple[str, str]]:
        """(field, message) for each field sent that the gateway refuses (empty: none)."""
        problems = check_extra_fields(self.model_extra or {}, set(type(self).model_fields))
        options = self.stream_options
        if options is not None and options.continuous_usage_stats:
            problems.append(
                (
                    "stream_options.continuous_usage_stats",
                    "stream_options.continuous_usage_stats is not served: usage comes in "
                    "the last chunk only (include_usage)",
                )
            )
        return problems

    def decode_sampling(self) -> dict[str, Any]:
        """Sampling fields forwarded to the decode instance as they were given
        (:data:`~flowprefill.gateway.openai_fields.PASSED_TO_DECODE`)."""
        keys = ("temperature", "top_p", "seed", "stop")
        sampling = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.ignore_eos:
            sampling["ignore_eos"] = True
        extra = self.model_extra or {}
        sampling |= {k: v for k, v in extra.items() if k in PASSED_TO_DECODE and v is not None}
        return sampling

    def first_token_ends(self, token_id: int, eos_token_ids: set[int]) -> bool:
        """Whether the first token ends the answer as vLLM would end it there: an
        end-of-sequence token (unless ``ignore_eos``) or one of ``stop_token_ids``."""
        stop_ids = (self.model_extra or {}).get("stop_token_ids") or ()
        return (token_id in eos_token_ids and not self.ignore_eos) or token_id in stop_ids


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(
        description="Text, or a list of token ids (one prompt: a list of prompts is refused)."
    )
    add_special_tokens: bool = Field(True, description="vLLM's: add the tokenizer's BOS etc.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
            raise ValueError("one prompt per request: a list of prompts is not served")
        return v

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

    @field_validator("content")
    @classmethod
    def _text_parts_only(
        cls, v: str | list[dict[str, Any]] | None
    ) -> str | list[dict[str, Any]] | None:
        # A text-only model: dropping an image part would answer a different question.
        for part in v if isinstance(v, list) else ():
            if part.get("type") != "text":
                raise ValueError(
                    f"content part of type {part.get('type')!r} is not served (text only)"
                )
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: role, text, and whatever else the
        client sent with it (``name``, ``tool_calls``, ``tool_call_id``, ...), as vLLM
        passes them on."""
        return {**(self.model_extra or {}), "role": self.role, "content": self.text()}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="End with the assistant's header.")
    continue_final_message: bool = Field(
        False, description="Leave the last message open (exclusive with the above)."
    )
    add_special_tokens: bool = Field(
        False, description="Add the tokenizer's special tokens on top of the template's."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the model's chat template."
    )

    @model_validator(mode="after")
    def _one_ending(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to "
                "True (add_generation_prompt defaults to true)."
            )
        return self


# vLLM's /tokenize and /detokenize (vllm/entrypoints/serve/tokenize/protocol.py, 0.32):
# the same fields and defaults; what a text-only gateway cannot honour is refused by name.


class _ModelOptional(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Checked when given (vLLM: optional).")


class _TokenizeFields(_ModelOptional):
    return_token_strs: bool | None = Field(
        False, description="Also return each id's vocabulary entry."
    )


class TokenizeCompletionRequest(_TokenizeFields):
    prompt: str = Field(description="Text to tokenize as /v1/completions would.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's BOS etc.")


class TokenizeChatRequest(_TokenizeFields):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="End with the assistant's header.")
    continue_final_message: bool = Field(
        False, description="Leave the last message open (exclusive with the above)."
    )
    add_special_tokens: bool = Field(
        False, description="Add the tokenizer's special tokens on top of the template's."
    )
    chat_template: str | None = Field(None, description="Refused: the model's template only.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the template."
    )
    tools: list[dict[str, Any]] | None = Field(None, description="Tools the template may list.")

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to "
                "True (add_generation_prompt defaults to true)."
            )
        return self


class DetokenizeRequest(_ModelOptional):
    tokens: list[int] = Field(description="Token ids, each within the vocabulary.")
