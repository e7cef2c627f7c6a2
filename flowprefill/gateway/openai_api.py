"""The OpenAI / vLLM request bodies the gateway serves, and what it does with every field.

Bodies: completions and chat completions (with vLLM's extra fields), and vLLM's
``/tokenize`` / ``/detokenize``. A chat's rendering options (:class:`ChatPrompt`: messages,
template flags, ``tools``) are one model shared by chat completions and ``/tokenize``, so
both tokenize a chat the same way (:func:`flowprefill.gateway.tokens.prompt_token_ids`).

The first token comes from a FlowPrefill prefill instance (greedy argmax over the prompt);
vLLM decode produces the rest. So a field is, for ``/v1/completions`` and
``/v1/chat/completions``:

- **served by the gateway** (:class:`SamplingFields` and its subclasses declare them:
  model, prompt, messages, token budgets, streaming, ``priority``, ``slo_class``, chat
  template options);
- **passed to decode** as given (:data:`PASSED_TO_DECODE`): they shape every token after
  the first;
- **accepted, no effect** (:data:`NO_EFFECT`): vLLM ignores them on these endpoints too,
  or they do not change the answer (metadata, ids, hints for OpenAI's own service);
- **refused unless at their default** (:data:`REFUSED`, and the declared ``tools`` and
  ``chat_template`` of a chat: :meth:`SamplingFields.refusals`,
  :meth:`ChatPrompt.template_refusal`): the answer would differ from vLLM's (the first
  token cannot honour them, or the gateway does not produce what they ask for) — a 400
  naming the field;
- anything else is **unknown** and refused with a 400 naming it (vLLM logs and ignores
  unknown fields; a field we do not know might change the answer).

docs/gateway.md has the table; tests/gateway/test_openai_fields.py checks that every field
of vLLM's installed request models is in exactly one of these sets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flowprefill.gateway.errors import ClientError

PASSED_TO_DECODE: Final = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "cache_salt",
        "repetition_detection",
        "thinking_token_budget",
        "stream_interval",
    }
)
"""Forwarded to vLLM decode when the client sent them (``ignore_eos`` also keeps an
end-of-sequence first token from ending the answer, ``stop_token_ids`` a listed one)."""

NO_EFFECT: Final = frozenset(
    {
        # vLLM: ids and metadata that do not change the output.
        "user",
        "request_id",
        "session_id",
        # vLLM: honoured only on its /render endpoints, ignored on these.
        "return_token_offsets",
        "mm_payload",
        "return_mm_kwargs",
        # vLLM: multimodal processing options (content parts other than text are refused).
        "media_io_kwargs",
        "mm_processor_kwargs",
        # vLLM: without a reasoning parser or tools these change nothing.
        "include_reasoning",
        "parallel_tool_calls",
        # vLLM: beam search only (refused below).
        "length_penalty",
        # OpenAI's service only.
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "prediction",
    }
)


def _default(*allowed: object) -> Callable[[Any], bool]:
    return lambda value: value in allowed or value is None


def _empty(value: Any) -> bool:
    return not value


REFUSED: Final[Mapping[str, tuple[Callable[[Any], bool], str]]] = {
    # What the first token (greedy, from prefill) cannot honour.
    "logit_bias": (_empty, "prefill's first token cannot apply a logit bias"),
    "allowed_token_ids": (_empty, "prefill's first token cannot be restricted"),
    "bad_words": (_empty, "prefill's first token cannot avoid words"),
    "min_tokens": (_default(0), "prefill's first token cannot suppress end-of-sequence"),
    "watermarking": (_default(False), "prefill's first token cannot be watermarked"),
    "response_format": (
        lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
        "structured output needs every token constrained, the first (prefill's) included",
    ),
    "structured_outputs": (_empty, "structured output needs every token constrained"),
    "use_beam_search": (_default(False), "beam search is not served"),
    # What the answer does not carry.
    "logprobs": (_default(False), "logprobs are not returned"),
    "top_logprobs": (_default(0), "logprobs are not returned"),
    "prompt_logprobs": (_default(), "logprobs are not returned"),
    "logprob_token_ids": (_empty, "logprobs are not returned"),
    "return_tokens_as_token_ids": (_default(False), "logprobs are not returned"),
    "return_token_ids": (_default(False), "token ids are not returned"),
    "return_prompt_text": (_default(False), "the rendered prompt is not returned"),
    "routed_experts_prompt_start": (_default(0), "routed experts are not returned"),
    "echo": (_default(False), "the prompt is not echoed"),
    "suffix": (_default(), "suffix is not served (nor by vLLM)"),
    "audio": (_default(), "audio output is not served"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is served"),
    "web_search_options": (_default(), "web search is not served"),
    "verbosity": (_default(), "verbosity is not served"),
    # Tools and reasoning: the answer is text; tool calls are not parsed out of it.
    "tool_choice": (_default("none", "auto"), "tool calls are not parsed"),
    "functions": (_empty, "function calls are not parsed"),
    "function_call": (_default("none", "auto"), "function calls are not parsed"),
    "reasoning_effort": (_default(), "reasoning effort is not passed to the template"),
    "documents": (_empty, "documents are not passed to the template"),
    # What the prompt would become: the gateway tokenizes, and refuses, as sent.
    "truncate_prompt_tokens": (_default(), "prompts are not truncated; shorten the prompt"),
    "truncation_side": (_default(), "prompts are not truncated"),
    "prompt_embeds": (_default(), "prompt embeddings are not served"),
    # The gateway's own hand-off to decode: never from a client.
    "kv_transfer_params": (_default(), "KV transfer is the gateway's own"),
    "ec_transfer_params": (_default(), "encoder-cache transfer is not served"),
    "vllm_xargs": (_empty, "custom vLLM extension arguments are not served"),
}
"""Field -> (is the value one the gateway serves as vLLM would?, why not otherwise)."""


def check_extra_fields(extra: Mapping[str, Any], declared: set[str]) -> list[tuple[str, str]]:
    """(field, message) for every field of ``extra`` (what the body has beyond the
    ``declared`` model fields) the gateway refuses; empty when all are fine."""
    problems = []
    for name, value in extra.items():
        if name in declared or name in PASSED_TO_DECODE or name in NO_EFFECT:
            continue
        if name in REFUSED:
            ok, why = REFUSED[name]
            if not ok(value):
                problems.append((name, f"{name}={_short(value)} is not served: {why}"))
            continue
        problems.append((name, f"unknown field {name!r} (docs/gateway.md lists what is served)"))
    return problems


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = Field(
        False, description="Send a last chunk with the usage and no choices (OpenAI semantics)."
    )
    continuous_usage_stats: bool | None = Field(
        False,
        description="vLLM's: with include_usage, every chunk also carries the usage so far "
        "(prompt, completion and total tokens); without include_usage, no effect (as vLLM).",
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
        "client may claim (flowprefill.gateway.classify), not sent to decode.",
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
    def usage_at_end(self) -> bool:
        """A last chunk with the usage (``stream_options.include_usage``)."""
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def usage_in_chunks(self) -> bool:
        """The usage so far in every chunk: vLLM's ``continuous_usage_stats``, which vLLM
        honours only together with ``include_usage`` (``should_include_usage``)."""
        options = self.stream_options
        return (
            options is not None
            and bool(options.include_usage)
            and bool(options.continuous_usage_stats)
        )

    @property
    def output_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    def refusals(self) -> list[tuple[str, str]]:
        """(field, message) for each field sent that the gateway refuses (empty: none)."""
        return check_extra_fields(self.model_extra or {}, set(type(self).model_fields))

    def decode_sampling(self) -> dict[str, Any]:
        """Sampling fields forwarded to the decode instance as they were given
        (:data:`PASSED_TO_DECODE`)."""
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


class ChatPrompt(BaseModel):
    """A chat and how to render it: what chat completions and ``/tokenize`` share, read by
    the one tokenization path (:func:`flowprefill.gateway.tokens.prompt_token_ids`)."""

    model_config = ConfigDict(extra="allow")

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
        None, description="Extra variables for the model's chat template."
    )
    tools: list[dict[str, Any]] | None = Field(None, description="Tools the template may list.")

    @model_validator(mode="after")
    def _one_ending(self) -> ChatPrompt:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to "
                "True (add_generation_prompt defaults to true)."
            )
        return self

    def template_refusal(self) -> ClientError | None:
        """The 400 for a chat template sent in the request (either place), else None: chats
        are rendered with the model's own template."""
        kwargs = self.chat_template_kwargs or {}
        for param, template in (
            ("chat_template", self.chat_template),
            ("chat_template_kwargs", kwargs.get("chat_template")),
        ):
            if template is not None:
                return ClientError(
                    400,
                    f"{param}: a chat template in the request is not served: chats are "
                    "rendered with the model's own template",
                    param=param,
                )
        return None


class ChatCompletionRequest(SamplingFields, ChatPrompt):
    def refusals(self) -> list[tuple[str, str]]:
        problems = super().refusals()
        if self.tools:
            problems.append(
                (
                    "tools",
                    f"tools={_short(self.tools)} is not served: tool calls are not parsed; "
                    "send tools to /tokenize only",
                )
            )
        return problems


# vLLM's /tokenize and /detokenize (vllm/entrypoints/serve/tokenize/protocol.py, 0.32):
# the same fields and defaults; what a text-only gateway cannot honour is refused by name.


class _ModelOptional(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Checked when given (vLLM: optional).")


def check_model(model: str | None, model_name: str, *, required: bool = True) -> None:
    """404 unless ``model`` is the served name (``required=False``: or not given, as
    vLLM's ``/tokenize`` allows)."""
    if model == model_name or (not required and not model):
        return
    raise ClientError(
        404,
        f"model {model!r} does not exist; this gateway serves {model_name!r}",
        param="model",
        type_="not_found_error",
    )


class _TokenizeFields(_ModelOptional):
    return_token_strs: bool | None = Field(
        False, description="Also return each id's vocabulary entry."
    )


class TokenizeCompletionRequest(_TokenizeFields):
    prompt: str = Field(description="Text to tokenize as /v1/completions would.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's BOS etc.")


class TokenizeChatRequest(_TokenizeFields, ChatPrompt):
    pass


class DetokenizeRequest(_ModelOptional):
    tokens: list[int] = Field(description="Token ids, each within the vocabulary.")
