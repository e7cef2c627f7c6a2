"""Garbage collection for the long-running servers (the gateway, the prefill instance).

Both build most of their objects at startup (modules, torch and the model, the tokenizer,
the app) and keep them for the life of the process. Python's cyclic collector would scan
all of them in every full collection, holding the GIL throughout, and while one runs the
prefill executor's thread cannot pass a checkpoint, so a preemption waits for it: with
tiny-llama on a 2-core machine and 10,000 requests waiting, full collections during a
prefill took up to 277 ms with Python's defaults and up to 39 ms with startup
frozen (``benchmarks/prefill/queued_blocking.py --gc python|frozen``; docs/scheduler.md).
:func:`freeze_startup` moves what exists into the permanent generation (``gc.freeze``,
as vLLM does after it starts), so later collections scan only what serving made.
"""

from __future__ import annotations

import gc

GATEWAY_YOUNG_THRESHOLD = 10_000
"""The gateway's allocations between two collections of the youngest generation (Python's
default: 700)."""


def freeze_startup(young_threshold: int | None = None) -> None:
    """Collect once, then freeze every object that survives out of later collections;
    cyclic garbage made afterwards is still collected. Call it when startup is done.

    ``young_threshold``: allocations between two collections of the youngest generation
    (None: Python's). The gateway allocates a few hundred objects per request, nearly all
    freed by reference counting when the request ends; collected every 10,000
    allocations instead of 700, a request's short-lived objects are mostly gone before a
    collection would scan them (and promote the live ones to older generations, which
    then make the full collections long). Measured under the throughput phase of
    benchmarks/gateway/overhead.py: collections took 8-11 % of the gateway's CPU with
    Python's defaults, about 1 % with that threshold. Older generations keep Python's
    thresholds."""
    gc.collect()
    gc.freeze()
    if young_threshold is not None:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(young_threshold, older, oldest)
