"""``POST /tokenize`` and ``POST /detokenize``: vLLM's endpoints, same JSON in and out.

``/tokenize`` takes ``{"model", "prompt"}`` (a completion: ``add_special_tokens`` defaults
to true) or ``{"model", "messages"}`` (a chat, rendered with the model's template:
``add_generation_prompt`` true, ``continue_final_message`` and ``add_special_tokens``
false by default) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``
(``token_strs`` null unless ``return_token_strs``). With the defaults the ids are exactly
what ``/v1/completions`` or ``/v1/chat/completions`` would send to prefill for the same
prompt. ``/detokenize`` takes ``{"model", "tokens"}`` and answers ``{"prompt"}``
(special tokens kept, as vLLM). ``model`` is optional, as in vLLM; a wrong one is a 404.

Clients use them to count tokens against ``max_model_len``; ``vllm bench serve`` uses
them to align its random prompts to the server's tokenizer before a run.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from flowprefill.gateway.admit import check_model
from flowprefill.gateway.errors import ClientError
from flowprefill.gateway.openai_models import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from flowprefill.gateway.tokenizer import Tokenizer

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
    if isinstance(body, TokenizeChatRequest):
        kwargs = body.chat_template_kwargs or {}
        if body.chat_template is not None or kwargs.get("chat_template") is not None:
            raise ClientError(
                400,
                "a chat template in the request is refused: this gateway renders chats "
                "with the model's own template",
                param="chat_template",
            )
        ids = tokenizer.encode_chat(
            [m.for_template() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=body.add_special_tokens,
            tools=body.tools,
            template_kwargs=kwargs,
        )
    else:
        ids = tokenizer.encode_prompt(body.prompt, add_special_tokens=body.add_special_tokens)
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
