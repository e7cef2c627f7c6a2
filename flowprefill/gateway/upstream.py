"""The gateway's two upstream calls, each in its server's wire format.

- :class:`PrefillClient`: ``POST /v1/prefill`` of a prefill instance
  (:mod:`flowprefill.contracts.prefill_api`), and ``DELETE /v1/kv/<id>`` of a hand-off
  decode will not load.
- :class:`DecodeClient`: a vLLM OpenAI server's streamed ``/v1/completions``, continuing
  from the prompt plus the first token and loading the prompt's KV through
  ``kv_transfer_params`` (:class:`~flowprefill.contracts.kv.HandoffRef`).

Failures are :class:`~flowprefill.gateway.errors.UpstreamError` (see
:mod:`flowprefill.gateway.transport`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from flowprefill.contracts.deployment import KV_HTTP_PATH, PREFILL_API_PATH
from flowprefill.contracts.kv import HandoffRef
from flowprefill.contracts.prefill_api import KVHandoffEvent, PrefillRequest, PrefillResponse
from flowprefill.errors import KVHandoffError
from flowprefill.gateway.errors import UpstreamError
from flowprefill.gateway.transport import UpstreamHTTP

log = logging.getLogger(__name__)

_BACKGROUND: set[asyncio.Task[Any]] = set()
"""Hand-off reads and releases nobody may await (first token EOS, client gone): the event
loop keeps only weak references to tasks."""


def _in_background(task: asyncio.Task[Any]) -> None:
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    """A prefill instance's answer: the first token at once, the KV hand-off once written."""

    response: PrefillResponse
    elapsed_s: float
    """The ``elapsed_s`` the request was sent with (gateway arrival → sent)."""
    prefill_url: str
    """The instance that answered (base URL): it serves ``DELETE /v1/kv/<id>``."""
    kv_pending: asyncio.Task[HandoffRef | None] | None = None
    """A streamed answer's rest: the hand-off once prefill has written it."""

    @property
    def first_token_id(self) -> int:
        return self.response.first_token_id

    @property
    def wait_s(self) -> float:
        """Time the request spent at the prefill instance (queue and prefill)."""
        return max(0.0, self.response.ttft_s - self.elapsed_s)

    async def hand_off(self) -> HandoffRef | None:
        """Where decode finds the prompt's KV cache; None: decode recomputes it."""
        if self.kv_pending is not None:
            return await self.kv_pending
        return _handoff(self.response.kv_transfer_params, self.response.request_id)


def _handoff(params: dict[str, Any] | None, request_id: str) -> HandoffRef | None:
    """The hand-off ``params`` name; None (decode recomputes) when they name none or
    cannot be used."""
    try:
        return HandoffRef.from_params(params)
    except KVHandoffError as e:
        log.warning("unusable KV hand-off for %s (%s); decode will recompute", request_id, e)
        return None


def _response(data: Any) -> PrefillResponse:
    try:
        if isinstance(data, str):
            return PrefillResponse.model_validate_json(data)
        return PrefillResponse.model_validate(data)
    except ValidationError as e:
        raise UpstreamError(
            502, f"prefill instance sent a malformed answer ({e})", "prefill_failed"
        ) from e


async def _streamed_handoff(
    payloads: AsyncGenerator[str, None], request_id: str
) -> HandoffRef | None:
    """Read a streamed prefill answer to its end; the hand-off its event names, if any.

    Never raises (but for cancellation): a hand-off that does not arrive (prefill died
    after the first token, a malformed event) means decode recomputes the prompt, not a
    failed request."""
    ref: HandoffRef | None = None
    try:
        async with aclosing(payloads):
            async for payload in payloads:
                event = KVHandoffEvent.model_validate_json(payload)
                ref = _handoff(event.kv_transfer_params, request_id)
    except Exception as e:
        log.warning("KV hand-off of %s did not arrive (%r); decode will recompute", request_id, e)
    return ref


class PrefillClient:
    def __init__(self, http: UpstreamHTTP) -> None:
        self.http = http

    async def prefill(
        self, url: str, request: PrefillRequest, headers: dict[str, str]
    ) -> PrefillAnswer:
        """The first token as soon as the instance at ``url`` has it. A streamed request
        (``request.stream``) gets the hand-off later (:meth:`PrefillAnswer.hand_off`), so
        writing the KV cache is not on the time to first token."""
        endpoint = f"{url}{PREFILL_API_PATH}"
        body = request.model_dump()
        if not request.stream:
            data = await self.http.post_json("prefill", endpoint, body, headers)
            return PrefillAnswer(_response(data), request.elapsed_s, url)
        payloads = self.http.sse("prefill", endpoint, body, headers)
        try:
            first = await anext(payloads, None)
            if first is None:
                raise UpstreamError(
                    502, "prefill instance ended its answer early", "prefill_failed"
                )
            response = _response(first)
        except BaseException:
            await payloads.aclose()
            raise
        task = asyncio.create_task(_streamed_handoff(payloads, request.request_id))
        _in_background(task)
        return PrefillAnswer(response, request.elapsed_s, url, kv_pending=task)

    def release(self, answer: PrefillAnswer) -> None:
        """Decode will not load this answer's KV hand-off: delete it through the prefill
        instance that answered (it wrote the file), on the port the gateway calls anyway —
        not at ``source``, the KV listener (``http`` transport) only decode may reach —
        instead of leaving it to prefill's age sweep, so it does not fill the disk. In the
        background; a failure only leaves the file to the sweep."""
        _in_background(asyncio.create_task(self._release(answer)))

    async def _release(self, answer: PrefillAnswer) -> None:
        ref = await answer.hand_off()
        if ref is None:
            return
        url = f"{answer.prefill_url}{KV_HTTP_PATH}{ref.handoff_id}"
        try:
            await self.http.delete("prefill", url)
        except UpstreamError as e:
            log.debug("release of KV hand-off %s failed (%s); left to the sweep", ref.handoff_id, e)


@dataclass(frozen=True, slots=True)
class DecodeDelta:
    text: str
    finish_reason: str | None = None
    completion_tokens: int | None = None


class DecodeClient:
    """Streams a continuation from a vLLM OpenAI server's ``/v1/completions``."""

    def __init__(self, http: UpstreamHTTP, model: str) -> None:
        self.http = http
        self.model = model

    async def stream(
        self,
        url: str,
        *,
        prompt_token_ids: list[int],
        max_tokens: int,
        sampling: dict[str, Any],
        handoff: HandoffRef | None,
        headers: dict[str, str],
        request_id: str,
    ) -> AsyncGenerator[DecodeDelta, None]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling,
        }
        if handoff is not None:
            body["kv_transfer_params"] = handoff.to_params()
        headers = {**headers, "x-request-id": request_id}
        payloads = self.http.sse("decode", f"{url}/v1/completions", body, headers)
        async with aclosing(payloads):  # an early exit closes the upstream connection now
            async for payload in payloads:
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise UpstreamError(502, str(chunk["error"]), "decode_stream_error")
                usage = chunk.get("usage") or {}
                choices = chunk.get("choices") or []
                if choices:
                    c = choices[0]
                    yield DecodeDelta(c.get("text") or "", c.get("finish_reason"))
                if usage.get("completion_tokens") is not None:
                    yield DecodeDelta("", None, int(usage["completion_tokens"]))
