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

**Budget.** The directory holds at most ``budget_bytes`` of hand-offs: a prompt whose
hand-off would go past it gets none (:class:`~flowprefill.errors.KVBudgetExceededError`;
the first token still goes out and decode recomputes the prompt). Not backpressure: holding
the engine's output until decode has pulled older hand-offs would put decode's stall on
every request's time to first token, the number this system is for; a recompute costs
decode one prefill of that prompt, and only while it is behind. Not eviction: a hand-off
already answered is one a decode may be loading. The bytes counted are the directory's (a
shared directory counts every writer's), plus those being written.
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
from flowprefill.errors import KVBudgetExceededError
from flowprefill.kv import ModelFingerprint, SharedDirTransport, build_handoff

KVSink = Callable[[str, Sequence[int], Any], dict[str, Any] | None]
"""(request id, prompt token ids, prefill output) → decode-side parameters."""


class DirectorySink:
    """A :data:`KVSink` writing into ``root``; ``source`` set → the answer names it;
    ``budget_bytes``: the most the directory may hold (None: unbounded; see above)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        model_config: Any,
        *,
        max_age_s: float = 600.0,
        source: str | None = None,
        budget_bytes: int | None = None,
    ) -> None:
        self.transport = SharedDirTransport(root)
        self.fingerprint = ModelFingerprint.from_config(model_config)
        self.max_age_s = max_age_s
        self.source = check_source_url(source) if source is not None else None
        self.budget_bytes = budget_bytes
        self._writing = 0
        """Bytes of hand-offs being written (reserved against the budget)."""
        self._last_sweep = time.monotonic()
        self._lock = threading.Lock()

    def held_bytes(self) -> int:
        return self.transport.held_bytes()

    def __call__(self, request_id: str, token_ids: Sequence[int], output: Any) -> dict[str, Any]:
        size = kv_nbytes(output.kv_cache)
        with self._lock:
            # A concurrent writer's temp file is on disk and in `_writing`: counted twice
            # while both exist, which errs on the side of the budget.
            if self.budget_bytes is not None:
                held = self.transport.held_bytes() + self._writing
                if held + size > self.budget_bytes:
                    raise KVBudgetExceededError(
                        f"KV hand-off of {size / 2**20:.1f} MiB would take the {held / 2**20:.1f} "
                        f"MiB held for decode past its budget of "
                        f"{self.budget_bytes / 2**20:.1f} MiB"
                    )
            self._writing += size
        try:
            handoff = build_handoff(
                output.kv_cache,
                token_ids,
                self.fingerprint,
                request_id=request_id,
                first_token_id=int(output.first_token_id),
            )
            self.transport.put(request_id, handoff)
        finally:
            with self._lock:
                self._writing -= size
        with self._lock:
            due = time.monotonic() - self._last_sweep > self.max_age_s / 4
            if due:
                self._last_sweep = time.monotonic()
        if due:
            self.transport.sweep(self.max_age_s)
        return HandoffRef(request_id, len(token_ids), source=self.source).to_params()


def kv_nbytes(layers: Any) -> int:
    """Bytes of a prompt's KV: every tensor of every layer's (key, value)."""
    return sum(int(t.numel()) * t.element_size() for layer in layers for t in layer)


def directory_sink(
    root: str | os.PathLike[str],
    model_config: Any,
    *,
    max_age_s: float = 600.0,
    source: str | None = None,
    budget_bytes: int | None = None,
) -> DirectorySink:
    return DirectorySink(
        root, model_config, max_age_s=max_age_s, source=source, budget_bytes=budget_bytes
    )


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
