"""The request fields that tie a decode request to a hand-off, and the load arithmetic.

A decode request carries ``kv_transfer_params`` (a top-level field of vLLM's OpenAI
``/v1/completions`` and ``/v1/chat/completions`` bodies; offline, the
``kv_transfer_params`` key of ``SamplingParams.extra_args``)::

    {"flowprefill": {"version": 1, "handoff_id": "<id>", "num_tokens": <KV tokens>,
                     "source": "http://<prefill pod>:<port>"}}

``source`` is present only when the hand-off is served over HTTP by the prefill instance
that wrote it (the ``http`` transport pulls it from ``<source>/v1/kv/<id>``); without it
the hand-off is in the shared directory, as before.

The finished response's ``kv_transfer_params`` reports what happened::

    {"flowprefill": {"handoff_id": "<id>", "loaded_tokens": <n>, "status": "loaded"}}

(``status`` is ``"recomputed"`` with a ``reason`` when the KV could not be used; the
request is then served by recomputing the prompt — slower, never wrong.)

Kept free of vLLM imports so the gateway and the unit tests can use it anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from flowprefill.kv.errors import KVHandoffError
from flowprefill.kv.transport import check_handoff_id

PARAMS_KEY = "flowprefill"
PARAMS_VERSION = 1


@dataclass(frozen=True)
class HandoffRef:
    """What the gateway tells decode: which hand-off holds this request's prompt KV."""

    handoff_id: str
    num_tokens: int | None = None
    source: str | None = None
    """Base URL of the prefill instance that serves the hand-off (``http`` transport)."""

    def __post_init__(self) -> None:
        if self.source is not None:
            object.__setattr__(self, "source", check_source_url(self.source))

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` value for a decode request body."""
        body: dict[str, Any] = {"version": PARAMS_VERSION, "handoff_id": self.handoff_id}
        if self.num_tokens is not None:
            body["num_tokens"] = self.num_tokens
        if self.source is not None:
            body["source"] = self.source
        return {PARAMS_KEY: body}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> HandoffRef | None:
        """None when the request carries no FlowPrefill hand-off (plain decode request)."""
        if not params or PARAMS_KEY not in params:
            return None
        body = params[PARAMS_KEY]
        if not isinstance(body, Mapping):
            raise KVHandoffError(f"kv_transfer_params.{PARAMS_KEY} must be an object")
        version = body.get("version", PARAMS_VERSION)
        if version != PARAMS_VERSION:
            raise KVHandoffError(f"kv_transfer_params version {version!r}, expected 1")
        num_tokens = body.get("num_tokens")
        if num_tokens is not None and (not isinstance(num_tokens, int) or num_tokens < 1):
            raise KVHandoffError(f"kv_transfer_params num_tokens must be >= 1: {num_tokens!r}")
        source = body.get("source")
        if source is not None and not isinstance(source, str):
            raise KVHandoffError(f"kv_transfer_params source must be a URL string: {source!r}")
        return cls(
            handoff_id=check_handoff_id(body.get("handoff_id", "")),
            num_tokens=num_tokens,
            source=source,
        )


def check_source_url(url: str) -> str:
    """An ``http(s)://host[:port][/prefix]`` base URL, without query, fragment or
    credentials; returned without a trailing slash."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or 0 < parts.port < 65536
    except (ValueError, AttributeError) as exc:
        raise KVHandoffError(f"hand-off source {url!r} is not a URL: {exc}") from exc
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or not port_ok
        or parts.query
        or parts.fragment
        or parts.username is not None
        or any(c.isspace() for c in url)
    ):
        raise KVHandoffError(
            f"hand-off source {url!r} must be an http:// or https:// base URL "
            "(host, optional port and path; no query, fragment or credentials)"
        )
    return url.rstrip("/")


def result_params(ref: HandoffRef, loaded_tokens: int, reason: str | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a finished decode request reports back."""
    body: dict[str, Any] = {
        "handoff_id": ref.handoff_id,
        "loaded_tokens": loaded_tokens,
        "status": "loaded" if reason is None else "recomputed",
    }
    if reason is not None:
        body["reason"] = reason
    return {PARAMS_KEY: body}


def load_end(num_kv_tokens: int, num_request_tokens: int) -> int:
    """How far into the request the hand-off's KV can be used (exclusive token index).

    vLLM must run the model on at least the last token of a new request to get logits to
    sample from (its scheduler asserts it schedules > 0 tokens), so at most
    ``num_request_tokens - 1`` tokens can come from outside. When the gateway sends
    ``prompt + [first_token]`` (the recommended shape) that bound is the whole prompt and
    decode recomputes nothing; when it sends the bare prompt, decode recomputes the last
    prompt token and re-samples the first token.
    """
    return max(0, min(num_kv_tokens, num_request_tokens - 1))


def num_tokens_to_load(num_kv_tokens: int, num_request_tokens: int, num_computed: int) -> int:
    """Tokens to load beyond the ``num_computed`` vLLM already holds (its prefix cache)."""
    return max(0, load_end(num_kv_tokens, num_request_tokens) - num_computed)
