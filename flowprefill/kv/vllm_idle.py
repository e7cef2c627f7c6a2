"""Shorter busy-wait of vLLM's worker between steps, for hosts that share a few CPU cores.

vLLM's worker process waits for the next step on a shared-memory queue and, for 1 s after
each read, busy-waits (``sched_yield`` in a loop) instead of sleeping, so the next step
starts a few microseconds sooner (``SpinCondition`` in
``vllm.distributed.device_communicators.shm_broadcast``; 1 s is fixed in vllm 0.32). On a
GPU node that spin has a core to itself. On a small CPU host beside a prefill instance it
takes a core away: a prefill that followed a decode step ran 1.6-1.8x slower for that
second (docs/stack.md), and stopping the spinning worker removed the slowdown.

``$FLOWPREFILL_VLLM_IDLE_SPIN_S`` (seconds, e.g. ``0``) caps that busy-wait in any vLLM
process that loads the FlowPrefill connector; unset leaves vLLM as it is. After the cap
the worker sleeps on vLLM's own notification socket, so nothing is lost but the spin.
``flowprefill up`` sets it to 0 for its decode instances.
"""

from __future__ import annotations

import logging
import os
from typing import Any

IDLE_SPIN_ENV = "FLOWPREFILL_VLLM_IDLE_SPIN_S"

logger = logging.getLogger("vllm.flowprefill.kv.idle")


def cap_idle_spin(seconds: float | None = None) -> float | None:
    """Cap the busy-wait of every vLLM shared-memory queue reader in this process to
    ``seconds`` (default: ``$FLOWPREFILL_VLLM_IDLE_SPIN_S``; nothing when unset).

    Returns the cap applied, or None. Applies to queues made before and after the call:
    the reader's own spin window is trimmed on its next wait. Idempotent."""
    if seconds is None:
        value = os.environ.get(IDLE_SPIN_ENV, "").strip()
        if not value:
            return None
        try:
            seconds = float(value)
        except ValueError:
            logger.warning(
                "%s=%r is not a number of seconds; left vLLM as it is", IDLE_SPIN_ENV, value
            )
            return None
    if seconds < 0:
        logger.warning("%s must be >= 0, got %s; left vLLM as it is", IDLE_SPIN_ENV, seconds)
        return None
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        logger.warning("vLLM has no SpinCondition here; %s has no effect", IDLE_SPIN_ENV)
        return None
    original = getattr(SpinCondition.wait, "__flowprefill_original__", SpinCondition.wait)
    cap = seconds

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if getattr(self, "is_reader", False) and getattr(self, "busy_loop_s", 0) > cap:
            self.busy_loop_s = cap
        original(self, timeout_ms)

    wait.__flowprefill_original__ = original  # type: ignore[attr-defined]
    SpinCondition.wait = wait  # type: ignore[method-assign]
    logger.info("vLLM idle busy-wait capped at %.3f s (%s)", cap, IDLE_SPIN_ENV)
    return cap
