"""The KV hand-off as other processes see it: the reference a decode request carries, the
report it answers with, and the vLLM connector configuration that loads it.

A decode request carries ``kv_transfer_params`` (a top-level field of vLLM's OpenAI
``/v1/completions`` and ``/v1/chat/completions`` bodies; offline, the
``kv_transfer_params`` key of ``SamplingParams.extra_args``)::

    {"flowprefill": {"version": 1, "handoff_id": "<id>", "num_tokens": <KV tokens>,
                     "source": "http://<prefill pod>:<port>"}}

``source`` is present only when the hand-off is served over HTTP by the prefill instance
that wrote it (the ``http`` transport pulls it from ``<source>/v1/kv/<id>``); without it
the hand-off is in the shared directory.

The finished response's ``kv_transfer_params`` reports what happened::

    {"flowprefill": {"handoff_id": "<id>", "loaded_tokens": <n>, "status": "loaded"}}

(``status`` is ``"recomputed"`` with a ``reason`` when the KV could not be used; the
request is then served by recomputing the prompt — slower, never wrong.)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from flowprefill.contracts.deployment import default_kv_cache_dir, default_kv_dir
from flowprefill.contracts.names import KVTransport
from flowprefill.contracts.nixl import RemotePrefill
from flowprefill.errors import KVHandoffError, UnknownNameError

PARAMS_KEY = "flowprefill"
PARAMS_VERSION = 1
CONNECTOR_MODULE = "flowprefill.kv.connector"
CONNECTOR_CLASS = "FlowPrefillConnector"

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_handoff_id(handoff_id: str) -> str:
    """Ids become file names: allow only a safe alphabet (no path traversal, no dot-files)."""
    if not isinstance(handoff_id, str) or not _ID_RE.match(handoff_id) or ".." in handoff_id:
        raise KVHandoffError(
            f"invalid hand-off id {handoff_id!r}: use 1-128 of [A-Za-z0-9_.-], not starting "
            "with '.' or '-' and without '..'"
        )
    return handoff_id


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


@dataclass(frozen=True)
class HandoffRef:
    """What the gateway tells decode: which hand-off holds this request's prompt KV."""

    handoff_id: str
    num_tokens: int | None = None
    source: str | None = None
    """Base URL of the prefill instance that serves the hand-off (``http`` transport)."""

    def __post_init__(self) -> None:
        check_handoff_id(self.handoff_id)
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


DecodeKV = HandoffRef | RemotePrefill
"""Where decode finds a prompt's KV: one of our hand-offs (our connector loads it) or a
NIXL producer's blocks (stock vLLM's ``NixlConnector`` pulls them)."""


def decode_kv(params: Mapping[str, Any] | None) -> DecodeKV | None:
    """The KV reference a prefill answer's ``kv_transfer_params`` carry, of either kind;
    None when they carry none. Raises :class:`KVHandoffError` when malformed."""
    remote = RemotePrefill.from_params(params)
    return remote if remote is not None else HandoffRef.from_params(params)


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


def connector_config() -> dict[str, object]:
    """vLLM's ``kv_transfer_config`` for our connector with its own defaults (the shared
    directory ``$FLOWPREFILL_KV_DIR`` of the decode process)."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_consumer",
        # A hand-off that fails while loading (truncated download, file swept) must mean
        # "recompute those blocks", never a failed request (vLLM's default is "fail").
        "kv_load_failure_policy": "recompute",
    }


def kv_transfer_config(
    storage_path: str | None = None,
    *,
    transport: KVTransport | str = KVTransport.SHARED_DIR,
    **extra: object,
) -> dict[str, object]:
    """The ``--kv-transfer-config`` / ``LLM(kv_transfer_config=...)`` value for decode.

    ``storage_path`` is the shared directory (``shared_dir``) or decode's local cache
    directory (``http``); None takes the environment's default. ``extra`` goes to
    ``kv_connector_extra_config`` (e.g. ``delete_after_load=False``, ``timeout_s=2``).
    """
    try:
        kind = KVTransport.parse(transport)
    except UnknownNameError as e:
        raise KVHandoffError(str(e)) from None
    if kind is KVTransport.HTTP:
        where: dict[str, object] = {
            "transport": kind.value,
            "cache_dir": storage_path or default_kv_cache_dir(),
        }
    else:
        where = {"shared_storage_path": storage_path or default_kv_dir()}
    return {**connector_config(), "kv_connector_extra_config": {**where, **extra}}
