"""HTTP clients of the gateway's upstreams: prefill instances and vLLM decode instances.

Failures become :class:`UpstreamError` with the status the gateway should answer (502 for
an instance that failed or vanished mid-request, 503 when none is available, 504 on
timeout) and a reason label for metrics; a 4xx from an upstream is passed through.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx


class UpstreamError(Exception):
    def __init__(self, status: int, message: str, reason: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retryable = retryable
        """True only when nothing was processed (connection refused): safe to try elsewhere."""


def _upstream_message(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (json.JSONDecodeError, AttributeError):
        pass
    return resp.text[:500] or resp.reason_phrase


def _translate(role: str, url: str, exc: httpx.HTTPError) -> UpstreamError:
    if isinstance(exc, httpx.ConnectError):
        return UpstreamError(
            503, f"{role} instance {url} is unreachable", f"{role}_unreachable", retryable=True
        )
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(504, f"{role} instance {url} timed out", f"{role}_timeout")
    return UpstreamError(
        502, f"{role} instance {url} failed mid-request ({type(exc).__name__})", f"{role}_failed"
    )


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    first_token_id: int
    num_prompt_tokens: int
    prefill_ms: float
    num_preemptions: int
    kv_transfer_params: dict[str, Any] | None


class PrefillClient:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def prefill(
        self,
        url: str,
        *,
        request_id: str,
        token_ids: list[int],
        ttft_budget_ms: float,
        slo_class: str,
        headers: dict[str, str],
        hand_off_kv: bool = True,
    ) -> PrefillAnswer:
        body = {
            "request_id": request_id,
            "prompt_token_ids": token_ids,
            "ttft_budget_ms": max(ttft_budget_ms, 0.001),
            "slo_class": slo_class,
            "hand_off_kv": hand_off_kv,
        }
        try:
            resp = await self.client.post(f"{url}/v1/prefill", json=body, headers=headers)
        except httpx.HTTPError as e:
            raise _translate("prefill", url, e) from e
        if resp.status_code >= 400:
            status = resp.status_code if resp.status_code < 500 else 502
            raise UpstreamError(status, _upstream_message(resp), f"prefill_{resp.status_code}")
        data = resp.json()
        return PrefillAnswer(
            first_token_id=int(data["first_token_id"]),
            num_prompt_tokens=int(data["num_prompt_tokens"]),
            prefill_ms=float(data["queue_and_prefill_ms"]),
            num_preemptions=int(data.get("num_preemptions", 0)),
            kv_transfer_params=data.get("kv_transfer_params"),
        )


@dataclass(frozen=True, slots=True)
class DecodeDelta:
    text: str
    finish_reason: str | None = None
    completion_tokens: int | None = None


class DecodeClient:
    """Streams a continuation from a vLLM OpenAI server's ``/v1/completions``."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self.client = client
        self.model = model

    async def stream(
        self,
        url: str,
        *,
        prompt_token_ids: list[int],
        max_tokens: int,
        sampling: dict[str, Any],
        kv_transfer_params: dict[str, Any] | None,
        headers: dict[str, str],
        request_id: str,
    ) -> AsyncIterator[DecodeDelta]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        headers = {**headers, "x-request-id": request_id}
        try:
            async with self.client.stream(
                "POST", f"{url}/v1/completions", json=body, headers=headers
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    status = resp.status_code if resp.status_code < 500 else 502
                    raise UpstreamError(
                        status, _upstream_message(resp), f"decode_{resp.status_code}"
                    )
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
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
        except httpx.HTTPError as e:
            raise _translate("decode", url, e) from e
