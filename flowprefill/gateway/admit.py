"""Stage 1 of the pipeline: admit an OpenAI request as a :class:`~flowprefill.gateway.job.Job`.

Checks the model name (404) and the fields sent (a 400 naming one the gateway refuses:
:mod:`flowprefill.gateway.openai_fields`), classifies into an SLO class and TTFT target
from what the request asks (:mod:`flowprefill.gateway.slo_request`,
:mod:`flowprefill.gateway.classify`), tokenizes the prompt or chat (a prompt of token ids
must stay within the vocabulary), and refuses a prompt plus output budget over the
context length (400 naming ``max_tokens`` or ``prompt``).
Pure but for the tokenizer: no HTTP, no upstream.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from flowprefill.contracts import SLOTable
from flowprefill.gateway.classify import classify
from flowprefill.gateway.errors import ClientError
from flowprefill.gateway.job import Job
from flowprefill.gateway.openai_models import ChatCompletionRequest, CompletionRequest
from flowprefill.gateway.slo_request import slo_request
from flowprefill.gateway.tokenizer import Tokenizer


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


def admit(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    arrival_s: float,
    headers: Mapping[str, str],
    path: str,
    model_name: str,
    table: SLOTable,
    tokenizer: Tokenizer,
) -> Job:
    """``headers`` must be case-insensitive (Starlette's are) or lower-cased. Raises
    :class:`~flowprefill.gateway.errors.ClientError`, or
    :class:`~flowprefill.errors.InvalidRequestError` when no class fits."""
    check_model(body.model, model_name)
    for field, message in body.refusals():
        raise ClientError(400, message, param=field)
    asked = slo_request(headers, body_class=body.slo_class, body_priority=body.priority)
    classification = classify(table, asked, headers=headers, model=body.model, path=path)
    if isinstance(body, ChatCompletionRequest):
        kwargs = body.chat_template_kwargs or {}
        if kwargs.get("chat_template") is not None:
            raise ClientError(
                400,
                "chat_template_kwargs.chat_template is not served: chats are rendered with "
                "the model's own template",
                param="chat_template_kwargs",
            )
        token_ids = tokenizer.encode_chat(
            [msg.for_template() for msg in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=body.add_special_tokens,
            template_kwargs=kwargs,
        )
    elif isinstance(body.prompt, str):
        token_ids = tokenizer.encode_prompt(body.prompt, body.add_special_tokens)
    else:
        token_ids = list(body.prompt)
        tokenizer.check_token_ids(token_ids, "prompt")
    limit = tokenizer.max_model_len
    if len(token_ids) + body.output_budget > limit:
        raise ClientError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt has "
            f"{len(token_ids)} and max_tokens asks for {body.output_budget} more",
            param="max_tokens" if len(token_ids) < limit else "prompt",
        )
    chat = isinstance(body, ChatCompletionRequest)
    return Job(
        request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        kind="chat.completion" if chat else "text_completion",
        body=body,
        token_ids=token_ids,
        classification=classification,
        arrival_s=arrival_s,
    )
