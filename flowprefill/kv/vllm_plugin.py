"""FlowPrefill's vLLM plugin: CPU-host settings for a decode process, by its environment.

vLLM imports every installed ``vllm.general_plugins`` entry point in each of its processes
(API server, engine core, workers) before it builds a model or a KV connector; this
package declares :func:`register` as one. It changes nothing unless the process's
environment asks, so a vLLM that merely shares a Python environment with FlowPrefill is
left as it is:

* ``$FLOWPREFILL_VLLM_IDLE_SPIN_S``: cap vLLM's idle busy-wait
  (:func:`flowprefill.kv.vllm_idle.cap_idle_spin`). Our own connector applies it too; the
  plugin extends it to stock vLLM pulling KV with its ``NixlConnector``.
* ``$FLOWPREFILL_NIXL_PROGRESS_THREAD=0``: NIXL agents this process creates start without
  NIXL's progress thread. That thread polls UCX without ever sleeping (the Python binding
  fixes its delay at 0), a core for the life of the process; on a CPU host shared with
  prefill it is half the machine. vLLM's consumer progresses its agent anyway whenever it
  checks its transfers and notifications, once per engine step.

``flowprefill up`` and the operator's CPU decode pools set both
(:func:`flowprefill.contracts.processes.decode_env`); GPU nodes set neither. Where the
decode image has no FlowPrefill installed the variables are inert and vLLM runs stock.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from flowprefill.contracts.nixl import NIXL_PROGRESS_THREAD_ENV
from flowprefill.kv.vllm_idle import cap_idle_spin

logger = logging.getLogger("vllm.flowprefill.plugin")

_PATCHED = "__flowprefill_no_progress_thread__"


def register() -> None:
    """vLLM's entry point: apply what this process's environment asks (see above)."""
    cap_idle_spin()
    value = os.environ.get(NIXL_PROGRESS_THREAD_ENV, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        disable_nixl_progress_thread()
    elif value not in ("", "1", "true", "yes", "on"):
        logger.warning(
            "%s=%r is not a boolean; left NIXL as it is", NIXL_PROGRESS_THREAD_ENV, value
        )


def disable_nixl_progress_thread() -> bool:
    """Make vLLM's NIXL agent configs default to no progress thread; False when vLLM or
    NIXL is missing here. Idempotent; an explicit ``enable_prog_thread`` still wins."""
    try:
        import vllm.distributed.nixl_utils as nixl_utils
    except ImportError:
        return False
    real = getattr(nixl_utils, "nixl_agent_config", None)  # vLLM resolves it lazily
    if real is None:
        return False
    if getattr(real, _PATCHED, False):
        return True

    def config(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_prog_thread", False)
        return real(*args, **kwargs)

    setattr(config, _PATCHED, True)
    # vLLM's connector modules import the name from nixl_utils (a lazily resolved module
    # attribute); those imported before this ran hold the original.
    for name, module in list(sys.modules.items()):
        if module is nixl_utils or (
            name.startswith("vllm.") and getattr(module, "nixl_agent_config", None) is real
        ):
            setattr(module, "nixl_agent_config", config)  # noqa: B010
    logger.info("NIXL agents in this process start without a progress thread")
    return True
