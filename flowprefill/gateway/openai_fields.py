"""What the gateway does with every field of an OpenAI / vLLM completions or chat request.

The first token comes from a FlowPrefill prefill instance (greedy argmax over the prompt);
vLLM decode produces the rest. So a field is, for ``/v1/completions`` and
``/v1/chat/completions``:

- **served by the gateway** (:class:`~flowprefill.gateway.openai_models.SamplingFields`
  and its subclasses declare them: model, prompt, messages, token budgets, streaming,
  ``priority``, ``slo_class``, chat template options);
- **passed to decode** as given (:data:`PASSED_TO_DECODE`): they shape every token after
  the first;
- **accepted, no effect** (:data:`NO_EFFECT`): vLLM ignores them on these endpoints too,
  or they do not change the answer (metadata, ids, hints for OpenAI's own service);
- **refused unless at their default** (:data:`REFUSED`): the answer would differ from
  vLLM's (the first token cannot honour them, or the gateway does not produce what they
  ask for) — a 400 naming the field;
- anything else is **unknown** and refused with a 400 naming it (vLLM logs and ignores
  unknown fields; a field we do not know might change the answer).

docs/gateway.md has the table; tests/gateway/test_openai_fields.py checks that every field
of vLLM's installed request models is in exactly one of these sets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

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
    "tools": (_empty, "tool calls are not parsed; send tools to /tokenize only"),
    "tool_choice": (_default("none", "auto"), "tool calls are not parsed"),
    "functions": (_empty, "function calls are not parsed"),
    "function_call": (_default("none", "auto"), "function calls are not parsed"),
    "reasoning_effort": (_default(), "reasoning effort is not passed to the template"),
    "documents": (_empty, "documents are not passed to the template"),
    "chat_template": (_default(), "chats are rendered with the model's own template"),
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
