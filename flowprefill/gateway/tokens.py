"""Tokenization in the gateway, one path for every endpoint: prompts and chats to token ids
(prefill and decode get ids, so both see exactly the same prompt), a first token id back
to text, and vLLM's ``/tokenize`` and ``/detokenize``.

:func:`prompt_token_ids` is the only place a request body becomes token ids: completions
and chat completions (stage 1, :func:`flowprefill.gateway.classify.intake`) and
``/tokenize`` call it, so ``/tokenize`` answers exactly the ids those endpoints send to
prefill for the same prompt or chat (``tools`` included; chat completions refuse tools
before tokenizing, :meth:`~flowprefill.gateway.openai_api.ChatCompletionRequest.refusals`),
and a chat template sent in the request is refused by both with the same 400.

A chat is rendered with the model's chat template to text, then that text is encoded
without the tokenizer's own special tokens (the template writes them): what
transformers' ``apply_chat_template(tokenize=True)`` and vLLM's renderer both do.

The gateway's tokenizer is a :class:`flowprefill.gateway.model_files.FileTokenizer` (the
model directory read with ``tokenizers`` and jinja2: the gateway runs without transformers);
:class:`Tokenizer` takes a transformers tokenizer as well (which gives the same ids).

``/tokenize`` takes ``{"model", "prompt"}`` (a completion: ``add_special_tokens`` defaults
to true) or ``{"model", "messages"}`` (a chat, rendered with the model's template:
``add_generation_prompt`` true, ``continue_final_message`` and ``add_special_tokens``
false by default) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``
(``token_strs`` null unless ``return_token_strs``). ``/detokenize`` takes
``{"model", "tokens"}`` and answers ``{"prompt"}`` (special tokens kept, as vLLM).
``model`` is optional, as in vLLM; a wrong one is a 404. Clients use them to count tokens
against ``max_model_len``; ``vllm bench serve`` uses them to align its random prompts to
the server's tokenizer before a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError

from flowprefill.gateway.errors import ClientError
from flowprefill.gateway.openai_api import (
    ChatPrompt,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    check_model,
)

# apply_chat_template's own parameters: a request's chat_template_kwargs may not set them
# (vLLM lets the request's flags win in the same way).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class Tokenizer:
    """The few tokenizer operations the gateway needs, on a
    :class:`~flowprefill.gateway.model_files.FileTokenizer` or a transformers tokenizer:
    what it calls on either is ``tok(text, add_special_tokens=...)["input_ids"]``,
    ``apply_chat_template(..., tokenize=False)``, ``decode``, ``convert_ids_to_tokens``,
    ``len()``, and for a fast one ``is_fast`` and ``backend_tokenizer`` (the
    ``tokenizers.Tokenizer``, which encoding calls directly when that gives the same ids).

    ``vocab_size``: ids ``0 .. vocab_size - 1`` are accepted in prompts; by default the
    tokenizer's length (the gateway passes the larger of that and the model's vocabulary,
    as vLLM checks token ids)."""

    def __init__(
        self,
        hf_tokenizer: Any,
        max_model_len: int,
        eos_token_ids: set[int],
        vocab_size: int | None = None,
    ) -> None:
        self.tok = hf_tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size if vocab_size is not None else len(hf_tokenizer)
        self._backend = _plain_backend(hf_tokenizer)
        self._token_texts: dict[int, str] = {}

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is not None:
            # The same ids, without the wrapper's ~3x overhead; encode_batch_fast skips the
            # character offsets nobody here reads (about half the CPU of encode for a long
            # prompt). ``ids`` is a new list each time: no copy.
            encoding = self._backend.encode_batch_fast(
                [prompt], add_special_tokens=add_special_tokens
            )[0]
            ids: list[int] = encoding.ids
            return ids
        return list(self.tok(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat rendered with the model's template, then encoded; ``add_special_tokens``
        adds the tokenizer's special tokens (e.g. BOS) on top of what the template writes.
        Raises :class:`ClientError` (400, ``messages``) when the template refuses them."""
        extra = {
            k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS
        }
        try:
            text = self.tok.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **extra,
            )
        except (TemplateError, ValueError, TypeError) as e:  # the template's raise_exception
            raise ClientError(
                400, f"messages: the model's chat template refused them: {e}", param="messages"
            ) from None
        return self.encode_prompt(str(text), add_special_tokens=add_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """The text of one token alone, special tokens skipped (a first token's text).
        Remembered per id: the same for every request, and at most one entry per id of
        the vocabulary (an id outside it is decoded each time)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = str(self.tok.decode([token_id], skip_special_tokens=True))
            if 0 <= token_id < self.vocab_size:
                self._token_texts[token_id] = text
        return text

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens included (vLLM's ``/detokenize``)."""
        return str(self.tok.decode(list(token_ids)))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (e.g. ``Ġworld``), as vLLM's ``return_token_strs``."""
        return [str(t) for t in self.tok.convert_ids_to_tokens(list(token_ids))]

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        """Raises :class:`ClientError` (400 naming ``param``) for an id outside the
        vocabulary (a prefill would index past its embedding table)."""
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            return  # all fine: two scans in C instead of a Python loop over the ids
        for i, t in enumerate(token_ids):
            if not 0 <= t < self.vocab_size:
                raise ClientError(
                    400,
                    f"{param}[{i}]: token id {t} is out of vocabulary "
                    f"(ids are 0 to {self.vocab_size - 1})",
                    param=param,
                )


def _plain_backend(hf_tokenizer: Any) -> Any:
    """The Rust tokenizer under a fast tokenizer, when calling it directly
    gives what ``hf_tokenizer(text)`` gives: no truncation, padding or special-token
    splitting configured (a call through the wrapper first resets those to its defaults,
    as every call through it does). None otherwise."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if not getattr(hf_tokenizer, "is_fast", False) or backend is None:
        return None
    hf_tokenizer("", add_special_tokens=True)
    plain = (
        backend.truncation is None
        and backend.padding is None
        and not getattr(backend, "encode_special_tokens", False)
    )
    return backend if plain else None


def prompt_token_ids(
    body: CompletionRequest | ChatPrompt | TokenizeCompletionRequest, tokenizer: Tokenizer
) -> list[int]:
    """The token ids prefill is sent for ``body`` (and ``/tokenize`` answers): a chat
    rendered with the model's template, a text prompt encoded, a prompt of ids checked
    against the vocabulary. Raises :class:`ClientError` (400)."""
    if isinstance(body, ChatPrompt):
        refusal = body.template_refusal()
        if refusal is not None:
            raise refusal
        return tokenizer.encode_chat(
            [m.for_template() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=body.add_special_tokens,
            tools=body.tools,
            template_kwargs=body.chat_template_kwargs,
        )
    if isinstance(body.prompt, str):
        return tokenizer.encode_prompt(body.prompt, add_special_tokens=body.add_special_tokens)
    token_ids = list(body.prompt)
    tokenizer.check_token_ids(token_ids, "prompt")
    return token_ids


M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], raw: dict[str, Any]) -> M:
    """The body as ``model``; a body that does not fit is answered as FastAPI answers one
    (400 naming the field)."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def parse_tokenize(raw: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A chat when the body has ``messages``, a completion when it has ``prompt``."""
    if "messages" in raw and "prompt" in raw:
        raise ClientError(400, "give either prompt or messages, not both", param="messages")
    if "messages" in raw:
        return _parse(TokenizeChatRequest, raw)
    if "prompt" not in raw:
        raise ClientError(400, "prompt or messages is required", param="prompt")
    return _parse(TokenizeCompletionRequest, raw)


def tokenize(
    body: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer: Tokenizer, model_name: str
) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse``. Raises :class:`ClientError`."""
    check_model(body.model, model_name, required=False)
    ids = prompt_token_ids(body, tokenizer)
    return {
        "count": len(ids),
        "max_model_len": tokenizer.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.token_strs(ids) if body.return_token_strs else None,
    }


def parse_detokenize(raw: dict[str, Any]) -> DetokenizeRequest:
    return _parse(DetokenizeRequest, raw)


def detokenize(body: DetokenizeRequest, tokenizer: Tokenizer, model_name: str) -> dict[str, Any]:
    """vLLM's ``DetokenizeResponse``. Raises :class:`ClientError`."""
    check_model(body.model, model_name, required=False)
    tokenizer.check_token_ids(body.tokens, "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}
