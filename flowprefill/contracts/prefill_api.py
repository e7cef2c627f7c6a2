"""The prefill instance's HTTP API (``POST /v1/prefill``), as the gateway and the server
both speak it.

The deadline travels as the class's SLO and the time the request already spent since
the gateway received it; the prefill instance rebuilds ``arrival_s = now - elapsed_s``
on its own clock, so ``deadline_s = arrival_s + ttft_slo_s`` and ``met_slo`` mean the
same thing in the gateway and in the engine (no clocks are compared across machines;
the request's network time to the prefill instance is the only part not counted).

With ``"stream": true`` the answer is server-sent events: a :class:`PrefillResponse`
as soon as the first token exists, then a :class:`KVHandoffEvent` once the hand-off is
written (``kv_transfer_params`` null if writing failed: decode recomputes), then
``[DONE]``.

Every answer also reports the instance's backlog (:class:`PrefillLoad`, the ``load``
field), and ``GET /v1/load`` (:data:`LOAD_PATH`) returns it on demand: what the gateway's
admission reads to see work it did not send (other gateways, direct clients) and how fast
the instance drains it, by the engine's own predictor.

A colocated instance (prefill beside its own vLLM decode, one pod of a ``role: colocated``
pool) also names that decode in every answer (``decode_url``): the gateway sends the
request's decode there first, so the KV hand-off stays inside the pod
(:mod:`flowprefill.gateway.decode`). Absent: any decode instance.
"""

from __future__ import annotations

import math
from typing import Any, Final
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flowprefill.contracts.kv import HandoffRef

LOAD_PATH: Final = "/v1/load"
"""``GET``: the prefill instance's :class:`PrefillLoad` now."""
COLOCATED_DECODE_URL_FLAG: Final = "--colocated-decode-url"
"""``serve-prefill``: the colocated instance's own decode, answered as ``decode_url``."""


class PrefillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=256, description="Unique per request.")
    prompt_token_ids: list[int] = Field(description="The tokenized prompt.")
    ttft_slo_s: float = Field(gt=0, description="The request's SLO class's TTFT target.")
    elapsed_s: float = Field(
        0.0,
        ge=0,
        description="Time since the gateway received the request (its arrival); the "
        "deadline is arrival + ttft_slo_s.",
    )
    slo_class: str = Field("default", max_length=128, description="SLO class name (metrics).")
    hand_off_kv: bool = Field(True, description="Write the KV hand-off for decode.")
    stream: bool = Field(
        False,
        description="Answer as server-sent events: the first token at once, the KV hand-off "
        "parameters when written.",
    )

    @field_validator("ttft_slo_s", "elapsed_s")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number of seconds")
        return value

    @property
    def remaining_s(self) -> float:
        """Budget left until the deadline when the gateway sent it (may be negative)."""
        return self.ttft_slo_s - self.elapsed_s


class PrefillLoad(BaseModel):
    """A prefill instance's backlog at one moment, as its engine sees it."""

    backlog_tokens: int = Field(
        ge=0,
        description="Prompt tokens still to prefill: waiting and parked requests, and what "
        "remains of the running task.",
    )
    queue_delay_s: float = Field(
        ge=0,
        description="The engine's TTFT predictor over backlog_tokens (0 when idle): how long "
        "a request due after all of it would wait before it starts.",
    )
    num_requests: int = Field(ge=0, description="Requests the backlog consists of.")


class PrefillResponse(BaseModel):
    request_id: str
    first_token_id: int
    num_prompt_tokens: int
    ttft_s: float = Field(
        description="Gateway arrival → first token, as the prefill instance measured it."
    )
    met_slo: bool = Field(description="ttft_s <= the class's ttft_slo_s.")
    num_preemptions: int
    batch_size: int
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="What decode needs to load this request's KV cache."
    )
    load: PrefillLoad | None = Field(
        None, description="The instance's backlog when it answered (this request excluded)."
    )
    decode_url: str | None = Field(
        None,
        description="A colocated instance's own decode (vLLM) base URL, ``http(s)://host:port``"
        " (in a pod its IP): where the gateway sends this request's decode first. None: the "
        "instance has no decode of its own.",
    )

    @field_validator("decode_url")
    @classmethod
    def _decode_url(cls, value: str | None) -> str | None:
        return None if value is None else check_decode_url(value)

    def handoff(self) -> HandoffRef | None:
        return HandoffRef.from_params(self.kv_transfer_params)


def check_decode_url(url: str) -> str:
    """``url`` as a decode base URL (no trailing slash); ValueError naming what is wrong
    unless it is ``http(s)://host:port`` with nothing after the port but ``/``."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"decode URL {url!r}: bad port ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"decode URL {url!r}: expected http(s)://host:port")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"decode URL {url!r}: expected a base URL, nothing after the port")
    return f"{parts.scheme}://{parts.netloc}"


class KVHandoffEvent(BaseModel):
    """Second event of a streamed answer: where decode finds the KV (null: recompute)."""

    kv_transfer_params: dict[str, Any] | None = None

    def handoff(self) -> HandoffRef | None:
        return HandoffRef.from_params(self.kv_transfer_params)
