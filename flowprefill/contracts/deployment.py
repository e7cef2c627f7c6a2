"""Ports, paths, readiness endpoints and environment variables shared between processes.

Every ``FLOWPREFILL_*`` variable any process reads is named here, with what reads it;
the code that reads one imports its name from here and nowhere spells it again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Final

# ------------------------------------------------------------------ ports and paths

GATEWAY_PORT: Final = 8000
PREFILL_PORT: Final = 8100
"""Prefill's API: ``/v1/prefill`` and ``DELETE /v1/kv/<id>`` (gateway), probes, /metrics."""
DECODE_PORT: Final = 8200
PREFILL_KV_PORT: Final = 8300
"""Prefill's KV hand-off listener (``http`` transport only): ``GET|HEAD|DELETE
/v1/kv/<id>``, for decode alone. A port of its own so that a NetworkPolicy can let decode
pods, and nobody else, read the prompt-derived KV (docs/operator.md)."""
PREFILL_SIDE_CHANNEL_PORT: Final = 5600
"""Prefill's NIXL handshake port (``nixl`` transport; vLLM's default side-channel port).
The KV itself moves between NIXL agents on UCX's own ports."""
DECODE_SIDE_CHANNEL_PORT: Final = 5700
"""A stock vLLM decode's own NIXL handshake port (``nixl`` transport), apart from
prefill's so both fit on one host."""
COLOCATED_HEALTH_PORT: Final = 8400
"""A colocated pod's launcher (``flowprefill_operator.colocated``): its own probe port,
``/health`` and ``/ready`` for both processes. The operator passes it in the launch spec;
the launcher (standard library only) reads it from there."""
COLOCATED_BEAT_SOCKET: Final = "/tmp/flowprefill-beats.sock"
"""A colocated pod's decode beats (decode-aware preemption): vLLM's beat connector sends to
it, the prefill engine listens on it. Under ``/tmp``, the pod's writable scratch
(an emptyDir; the root filesystem is read-only), shared by both processes of the one
container."""

HEALTH_PATH: Final = "/health"
"""Liveness of every process (vLLM's /health too)."""
READY_PATH: Final = "/ready"
"""Readiness of the gateway and prefill (503 while draining or with no upstream)."""
DECODE_READY_PATH: Final = "/health"
"""vLLM has no separate readiness endpoint: /health answers once the engine is up."""
METRICS_PATH: Final = "/metrics"
PREFILL_API_PATH: Final = "/v1/prefill"
KV_HTTP_PATH: Final = "/v1/kv/"
"""Where a prefill instance serves its hand-offs: ``GET|HEAD|DELETE <source>/v1/kv/<id>`` on
its KV port (``source`` names it); ``DELETE`` also on its main port, for the gateway."""

# HTTP headers between clients, the gateway and its upstreams.
SLO_CLASS_HEADER: Final = "x-slo-class"
"""Client -> gateway: the SLO class a request claims (honoured where the class's claim
rule admits the client: docs/gateway.md)."""
SLO_OBJECTIVE_HEADERS: Final = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
"""Client -> gateway: the name of the objective (our SLO class), claimed as ``x-slo-class``
is: llm-d's current name first, then the Gateway API Inference Extension's older one (llm-d
keeps it as a deprecated alias). A request sending both is read by the first (the current
name wins). Gateway -> upstreams: the class used, under every name."""
SLO_OBJECTIVE_HEADER: Final = SLO_OBJECTIVE_HEADERS[0]
"""The preferred (current llm-d) name of :data:`SLO_OBJECTIVE_HEADERS`."""
SLO_TTFT_HEADERS: Final = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
"""Client -> gateway: the request's own TTFT target in ms (llm-d / Inference Extension
convention; looser than its class always honoured, tighter only where the class allows):
llm-d's current name first, then the older one it keeps as a deprecated alias; the first
sent wins. Gateway -> prefill and decode: the TTFT budget left when the call is sent (a
hint; the deadline itself travels in the prefill body), under every name."""
SLO_TTFT_HEADER: Final = SLO_TTFT_HEADERS[0]
"""The preferred (current llm-d) name of :data:`SLO_TTFT_HEADERS`."""


def first_header(headers: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    """The first of ``names`` (preferred first: the current name wins over its deprecated
    alias) that ``headers`` carries non-blank, as (name, value); None when none is sent.
    ``headers`` must be case-insensitive (Starlette's, httpx's) or lower-cased."""
    for name in names:
        value = headers.get(name)
        if value is not None and value.strip():
            return name, value
    return None


SLO_TPOT_HEADER: Final = "x-slo-tpot-ms"
"""Gateway -> upstreams: the class's time-per-output-token target, when it has one."""
SLO_PRIORITY_HEADER: Final = "x-dynamo-request-priority"
"""Client -> gateway: NVIDIA Dynamo's request priority (higher = more urgent), mapped to
the nearest class the client may claim; gateway -> upstreams: the class's priority."""
SLO_CLASS_USED_HEADER: Final = "x-flowprefill-slo-class"
"""Gateway -> client: the class the request was served in (every answer)."""
SLO_FALLBACK_HEADER: Final = "x-flowprefill-slo-class-fallback"
"""Gateway -> client: what the request asked for and did not get, with the reason
(:class:`flowprefill.contracts.slo.Fallback`), and what was used instead."""

# Files in a pod (the operator mounts ConfigMaps there).
CONFIG_DIR: Final = "/etc/flowprefill"
ENGINE_CONFIG_PATH: Final = f"{CONFIG_DIR}/engine.json"
GATEWAY_CONFIG_PATH: Final = f"{CONFIG_DIR}/gateway.json"
SLO_DIR: Final = f"{CONFIG_DIR}/slo"
SLO_TABLE_FILE: Final = "slo-table.json"
PROFILE_DIR: Final = f"{CONFIG_DIR}/profile"

# ------------------------------------------------------------- environment variables

KV_DIR_ENV: Final = "FLOWPREFILL_KV_DIR"
"""Prefill and decode: the shared hand-off directory when no config names one."""
DEFAULT_KV_DIR: Final = "/tmp/flowprefill-kv"
KV_CACHE_DIR_ENV: Final = "FLOWPREFILL_KV_CACHE_DIR"
"""Decode (http transport): local copies of pulled hand-offs when no config names one."""
DEFAULT_KV_CACHE_DIR: Final = "/tmp/flowprefill-kv-cache"
KV_ADVERTISE_URL_ENV: Final = "FLOWPREFILL_KV_ADVERTISE_URL"
"""Prefill (http transport): the base URL decode pulls from, on the KV port (in a pod:
``http://<pod IP>:PREFILL_KV_PORT``)."""
KERNELS_ENV: Final = "FLOWPREFILL_KERNELS"
"""Prefill: executor kernels when engine.json names none (``fast`` | ``reference``)."""
MODEL_CACHE_ENV: Final = "FLOWPREFILL_MODEL_CACHE"
"""Where built-in tiny models are materialised (default ~/.cache/flowprefill/models)."""
VLLM_IDLE_SPIN_ENV: Final = "FLOWPREFILL_VLLM_IDLE_SPIN_S"
"""Decode (vLLM with our connector): cap of vLLM's idle busy-wait, seconds; unset = vLLM's."""
CPU_VLLM_IDLE_SPIN_S: Final = "0.005"
"""The cap for decode on CPU hosts shared with prefill (docs/kv.md: 0 makes decode 1.75x
slower, 5 ms is no slower than vLLM's default)."""
HF_TOKEN_SOURCE_ENV: Final = "FLOWPREFILL_HF_TOKEN_SOURCE"
"""A pod's download step (set by the operator): where its ``HF_TOKEN`` comes from
(``Secret NAME key KEY``), so that a refused token's message names what to fix."""
OPERATOR_ENV_PREFIX: Final = "FLOWPREFILL_OPERATOR_"
"""The operator's settings (flowprefill_operator.settings)."""

POD_IP_ENV: Final = "POD_IP"

OFFLINE_ENV: Final = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""The serving processes download nothing: models and tokenizers come from local
directories (in a pod, put there by its ``fetch-model`` step: flowprefill.fetch)."""


def env_or(name: str, default: str) -> str:
    """``$name`` when set and not blank, else ``default``."""
    value = os.environ.get(name, "").strip()
    return value or default


def default_kv_dir() -> str:
    return env_or(KV_DIR_ENV, DEFAULT_KV_DIR)


def default_kv_cache_dir() -> str:
    return env_or(KV_CACHE_DIR_ENV, DEFAULT_KV_CACHE_DIR)
