"""Shorter busy-wait of vLLM's worker between steps, for hosts that share a few CPU cores.

vLLM's worker process waits for the next step on a shared-memory queue and, for 1 s after
each read, busy-waits (``sched_yield`` in a loop) instead of sleeping, so the next step
starts a few microseconds sooner (``SpinCondition`` in
``vllm.distributed.device_communicators.shm_broadcast``; 1 s is fixed in vllm 0.32). On a
GPU node that spin has a core to itself. On a small CPU host beside a prefill instance it
takes a core away from prefill for a second after every decode step (measured in
docs/kv.md, "vLLM's idle busy-wait").

``$FLOWPREFILL_VLLM_IDLE_SPIN_S`` (seconds, e.g. ``0``) caps that busy-wait in every vLLM
process that builds the FlowPrefill connector (its constructor calls :func:`cap_idle_spin`;
importing :mod:`flowprefill.kv.connector` patches nothing); unset leaves vLLM as it is.
After the cap the reader sleeps on vLLM's notification socket, but never longer than
``POLL_SLICE_MS`` before looking at the queue again. The slice is not optional: vLLM's
writer publishes its "written" notification on a PUB socket with a send high-water mark of
1, and when two messages follow each other within a fraction of a millisecond (the engine
sends ``execute_model`` and ``sample_tokens`` back to back every decode step) the second
notification can be dropped. vLLM's 1 s spin hides that; a reader that only sleeps until
notified would wait out vLLM's 5 s recheck interval once per decode step. With the slice
a dropped notification costs at most ``POLL_SLICE_MS``, and an idle reader wakes
``1000 / POLL_SLICE_MS`` times a second, microseconds each, instead of spinning on a core.

``flowprefill up`` and the operator's CPU decode pools set the cap to
``contracts.deployment.CPU_VLLM_IDLE_SPIN_S`` for their decode instances: 5 ms of
spin still catches the second message of a pair without a sleep, where a cap of 0 leaves
every step to the slice (docs/kv.md gives the decode times of both).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from flowprefill.contracts.deployment import VLLM_IDLE_SPIN_ENV

# The variable and the CPU hosts' cap (``flowprefill up``, the operator's CPU decode pools)
# are deployment contracts (``flowprefill.contracts.deployment``).
POLL_SLICE_MS = 10
"""Longest sleep of a capped reader before it looks at its queue again (see above)."""

logger = logging.getLogger("vllm.flowprefill.kv.idle")


def cap_idle_spin(seconds: float | None = None) -> float | None:
    """Cap the busy-wait of every vLLM shared-memory queue reader in this process to
    ``seconds`` (default: ``$FLOWPREFILL_VLLM_IDLE_SPIN_S``; nothing when unset).

    Returns the cap applied, or None. Applies to queues made before and after the call:
    the reader's own spin window is trimmed on its next wait. Idempotent."""
    if seconds is None:
        value = os.environ.get(VLLM_IDLE_SPIN_ENV, "").strip()
        if not value:
            return None
        try:
            seconds = float(value)
        except ValueError:
            logger.warning(
                "%s=%r is not a number of seconds; left vLLM as it is", VLLM_IDLE_SPIN_ENV, value
            )
            return None
    if seconds < 0:
        logger.warning("%s must be >= 0, got %s; left vLLM as it is", VLLM_IDLE_SPIN_ENV, seconds)
        return None
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        logger.warning("vLLM has no SpinCondition here; %s has no effect", VLLM_IDLE_SPIN_ENV)
        return None
    original = getattr(SpinCondition.wait, "__flowprefill_original__", SpinCondition.wait)
    cap = seconds

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if getattr(self, "is_reader", False) and getattr(self, "busy_loop_s", 0) > cap:
            self.busy_loop_s = cap
        # The caller (MessageQueue.acquire_read) re-checks the queue and waits again after
        # any return, so a shorter sleep only bounds the cost of a dropped notification.
        if timeout_ms is None or timeout_ms > POLL_SLICE_MS:
            timeout_ms = POLL_SLICE_MS
        original(self, timeout_ms)

    wait.__flowprefill_original__ = original  # type: ignore[attr-defined]
    SpinCondition.wait = wait  # type: ignore[method-assign]
    logger.info("vLLM idle busy-wait capped at %.3f s (%s)", cap, VLLM_IDLE_SPIN_ENV)
    return cap
