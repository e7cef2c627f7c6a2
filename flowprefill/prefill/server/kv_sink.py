"""Handing a finished prefill's KV to decode.

The prefill server writes each request's prompt KV as one hand-off file named by the
request id, in a directory (:class:`~flowprefill.kv.transport.SharedDirTransport`), and
answers with the ``kv_transfer_params`` decode needs to find it:

* ``shared_dir`` transport: decode reads the same directory (a shared volume).
* ``http`` transport: the directory is this instance's own; the prefill server serves it
  at ``GET /v1/kv/<id>`` on its KV listener (:mod:`flowprefill.prefill.server.kv_http`) and the
  parameters carry ``source`` = that listener's advertised base URL, from which decode
  pulls the file.

Files a decode never consumed (client gone) are swept after ``max_age_s``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from flowprefill.contracts.deployment import KV_ADVERTISE_URL_ENV
from flowprefill.contracts.kv import HandoffRef, check_source_url
from flowprefill.kv import ModelFingerprint, SharedDirTransport, build_handoff

KVSink = Callable[[str, Sequence[int], Any], dict[str, Any] | None]
"""(request id, prompt token ids, prefill output) → decode-side parameters."""


class DirectorySink:
    """A :data:`KVSink` writing into ``root``; ``source`` set → the answer names it."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        model_config: Any,
        *,
        max_age_s: float = 600.0,
        source: str | None = None,
    ) -> None:
        self.transport = SharedDirTransport(root)
        self.fingerprint = ModelFingerprint.from_config(model_config)
        self.max_age_s = max_age_s
        self.source = check_source_url(source) if source is not None else None
        self._last_sweep = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, request_id: str, token_ids: Sequence[int], output: Any) -> dict[str, Any]:
        handoff = build_handoff(
            output.kv_cache,
            token_ids,
            self.fingerprint,
            request_id=request_id,
            first_token_id=int(output.first_token_id),
        )
        self.transport.put(request_id, handoff)
        with self._lock:
            due = time.monotonic() - self._last_sweep > self.max_age_s / 4
            if due:
                self._last_sweep = time.monotonic()
        if due:
            self.transport.sweep(self.max_age_s)
        return HandoffRef(request_id, len(token_ids), source=self.source).to_params()


def directory_sink(
    root: str | os.PathLike[str],
    model_config: Any,
    *,
    max_age_s: float = 600.0,
    source: str | None = None,
) -> DirectorySink:
    return DirectorySink(root, model_config, max_age_s=max_age_s, source=source)


def advertise_url(host: str, port: int, explicit: str | None = None) -> str:
    """The base URL decode instances use to pull this instance's hand-offs; ``port`` is
    the KV listener's.

    ``explicit`` (``--kv-advertise-url``), else ``$FLOWPREFILL_KV_ADVERTISE_URL`` (on
    Kubernetes: ``http://$(POD_IP):<KV port>`` from the downward API), else ``http://<host>:
    <port>`` — for a wildcard bind host (0.0.0.0, ::) the address this machine's hostname
    resolves to (in a pod, /etc/hosts maps it to the pod IP).
    """
    url = explicit or os.environ.get(KV_ADVERTISE_URL_ENV)
    if not url:
        if host in ("", "0.0.0.0", "::"):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        try:
            if ipaddress.ip_address(host).version == 6:
                host = f"[{host}]"
        except ValueError:
            pass  # a host name
        url = f"http://{host}:{port}"
    return check_source_url(url)
