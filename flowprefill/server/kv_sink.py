"""Handing a finished prefill's KV to decode through the shared-directory transport.

The prefill server writes each request's prompt KV as one hand-off file named by the
request id and answers with the ``kv_transfer_params`` decode needs to find it. Files a
decode never consumed (client gone) are swept after ``max_age_s``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from flowprefill.kv import HandoffRef, ModelFingerprint, SharedDirTransport, build_handoff

KVSink = Callable[[str, Sequence[int], Any], dict[str, Any] | None]
"""(request id, prompt token ids, prefill output) → decode-side parameters."""


def directory_sink(
    root: str | os.PathLike[str], model_config: Any, *, max_age_s: float = 600.0
) -> KVSink:
    transport = SharedDirTransport(root)
    fingerprint = ModelFingerprint.from_config(model_config)
    last_sweep = [time.monotonic()]
    lock = threading.Lock()

    def sink(request_id: str, token_ids: Sequence[int], output: Any) -> dict[str, Any]:
        handoff = build_handoff(
            output.kv_cache,
            token_ids,
            fingerprint,
            request_id=request_id,
            first_token_id=int(output.first_token_id),
        )
        transport.put(request_id, handoff)
        with lock:
            due = time.monotonic() - last_sweep[0] > max_age_s / 4
            if due:
                last_sweep[0] = time.monotonic()
        if due:
            transport.sweep(max_age_s)
        return HandoffRef(request_id, len(token_ids)).to_params()

    return sink
