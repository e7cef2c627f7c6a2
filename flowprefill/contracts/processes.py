"""The processes of a deployment, described once and rendered by ``flowprefill up`` (child
processes on one machine) and by the operator (containers in pods).

A :class:`ProcessSpec` says what runs (argv after the launcher), which environment the
product needs, the port, and the health and readiness paths. Where things live differs
between the two renderers and is passed in: the :class:`Launcher` (an installed
``flowprefill`` in an image, ``python -m flowprefill.cli`` locally), file paths, the
listen host and the address decode uses to reach a prefill pod. Everything else —
subcommands, flags, environment variable names, ports, probes, the connector config —
comes from here, so the two cannot drift (tests/test_processes.py renders both and
compares them).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flowprefill.contracts.beats import with_beats
from flowprefill.contracts.deployment import (
    CPU_VLLM_IDLE_SPIN_S,
    DECODE_READY_PATH,
    HEALTH_PATH,
    KV_ADVERTISE_URL_ENV,
    PREFILL_KV_PORT,
    READY_PATH,
    VLLM_IDLE_SPIN_ENV,
)
from flowprefill.contracts.kv import connector_config, kv_transfer_config
from flowprefill.contracts.names import KVTransport, Role
from flowprefill.contracts.nixl import (
    FLASH_ATTENTION,
    NIXL_PROGRESS_THREAD_ENV,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_PORT_ENV,
    consumer_kv_transfer_config,
)

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class Launcher:
    """How a renderer starts our CLI and vLLM's OpenAI server."""

    flowprefill: tuple[str, ...]
    vllm: tuple[str, ...]

    @classmethod
    def image(cls) -> Launcher:
        """In the container images: the installed console script and the image's python."""
        return cls(("flowprefill",), ("python", "-m", VLLM_SERVER_MODULE))

    @classmethod
    def local(cls) -> Launcher:
        """On this machine: the running interpreter, so a venv needs no activation."""
        return cls(
            (sys.executable, "-m", "flowprefill.cli"), (sys.executable, "-m", VLLM_SERVER_MODULE)
        )


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a deployment: ``launcher + args``, the product's environment
    (names from :mod:`flowprefill.contracts.deployment`), its ports and probe paths."""

    role: Role
    launcher: tuple[str, ...]
    args: tuple[str, ...]
    port: int
    ready_path: str
    health_path: str = HEALTH_PATH
    env: Mapping[str, str] = field(default_factory=dict)
    kv_port: int | None = None
    """Prefill with the ``http`` KV transport: the port only decode reaches (hand-off
    reads); None where the process has no such listener."""

    @property
    def argv(self) -> list[str]:
        return [*self.launcher, *self.args]


def _listen(host: str | None, port: int) -> tuple[str, ...]:
    # No --host: the servers' default, every interface (what a pod wants).
    return ("--host", host, "--port", str(port)) if host else ("--port", str(port))


def prefill_process(
    launcher: Launcher,
    *,
    engine_config_path: str,
    port: int,
    host: str | None = None,
    kv_transport: KVTransport | None = None,
    advertise_host: str | None = None,
    kv_port: int = PREFILL_KV_PORT,
) -> ProcessSpec:
    """``flowprefill serve-prefill``: every setting is in ``engine.json``
    (:class:`~flowprefill.contracts.engine.EngineConfig`), so the argv is only where that
    file is and where to listen. With the ``http`` KV transport the process also listens on
    ``kv_port`` (``--kv-port``), the only port that serves hand-off reads, and decode pulls
    from ``http://<advertise_host>:<kv_port>`` (in a pod: its IP, ``$(POD_IP)``)."""
    env: dict[str, str] = {}
    args = ["serve-prefill", "--config", engine_config_path, *_listen(host, port)]
    served_kv_port = None
    if kv_transport is KVTransport.HTTP:
        if advertise_host is None:
            raise ValueError("the http KV transport needs the address decode reaches prefill at")
        env[KV_ADVERTISE_URL_ENV] = f"http://{advertise_host}:{kv_port}"
        args += ["--kv-port", str(kv_port)]
        served_kv_port = kv_port
    return ProcessSpec(
        role=Role.PREFILL,
        launcher=launcher.flowprefill,
        args=tuple(args),
        port=port,
        ready_path=READY_PATH,
        env=env,
        kv_port=served_kv_port,
    )


DRAIN_TIMEOUT_FLAG = "--drain-timeout"
"""``serve-prefill`` and ``serve-gateway``: seconds in-flight requests may take to finish
on SIGTERM (the operator sets it per pod; docs/pods.md)."""


def decode_process(
    launcher: Launcher,
    *,
    model_path: str,
    port: int,
    kv_transport: KVTransport | None,
    kv_path: str | None = None,
    host: str | None = None,
    cpu: bool = False,
    tensor_parallel_size: int = 1,
    extra_args: Sequence[str] = (),
    side_channel_port: int | None = None,
    beat_sockets: Sequence[str] = (),
) -> ProcessSpec:
    """vLLM's OpenAI server loading hand-offs through the FlowPrefill connector, or with
    the ``nixl`` transport stock vLLM pulling them with its ``NixlConnector`` (no
    FlowPrefill connector in the process; ``side_channel_port`` is its own NIXL handshake
    port, which must differ between decode instances on one host).

    ``kv_path``: the shared hand-off directory (``shared_dir``) or this instance's cache
    of pulled hand-offs (``http``); no transport leaves the connector its defaults (the
    shared directory of ``$FLOWPREFILL_KV_DIR``). On a CPU host the connector caps vLLM's
    idle busy-wait (docs/kv.md), which a GPU node does not need.
    ``tensor_parallel_size > 1``: vLLM runs that many ranks itself
    (``--tensor-parallel-size``); one rank adds no flag (vLLM's default).
    ``beat_sockets``: the prefill instances on the same device with decode-aware preemption
    on; the beat connector beside the KV connector sends them its step beats
    (:func:`~flowprefill.contracts.beats.with_beats`)."""
    env: dict[str, str] = decode_env(cpu=cpu)
    config: dict[str, object]
    if kv_transport is KVTransport.NIXL:
        config = consumer_kv_transfer_config(device="cpu" if cpu else "cuda")
        if side_channel_port is not None:
            env[SIDE_CHANNEL_PORT_ENV] = str(side_channel_port)
        if host:
            env[SIDE_CHANNEL_HOST_ENV] = host
    elif kv_transport is not None:
        config = kv_transfer_config(kv_path, transport=kv_transport)
    else:
        config = connector_config()
    if beat_sockets:
        config = with_beats(config, tuple(beat_sockets))
    args = [
        "--model", model_path, *_listen(host, port),
        "--kv-transfer-config", json.dumps(config, separators=(",", ":")),
    ]  # fmt: skip
    if kv_transport is KVTransport.NIXL and not cpu:
        # Our pages are written in FLASH_ATTN's layout (flowprefill.kv.nixl.layout); a
        # decode that picked another backend would refuse the handshake (the backend is in
        # its hash) and recompute every prompt.
        args += ["--attention-backend", FLASH_ATTENTION]
    if tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return ProcessSpec(
        role=Role.DECODE,
        launcher=launcher.vllm,
        args=(*args, *extra_args),
        port=port,
        ready_path=DECODE_READY_PATH,
        env=env,
    )


USAGE_STATS_OFF_ENV: Mapping[str, str] = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
"""vLLM reports usage statistics to its maintainers unless told not to: its own switch, and
the cross-tool ``DO_NOT_TRACK`` it also honours. Every image sets both (docs/images.md);
decode processes get them here too, so a process started outside our images (``flowprefill
up``, a user's own vLLM image under the operator) sends nothing either."""


def decode_env(*, cpu: bool) -> dict[str, str]:
    """What a decode process needs from its environment: usage statistics off
    (:data:`USAGE_STATS_OFF_ENV`) and, on a CPU host shared with prefill, the cap of vLLM's
    idle busy-wait and no NIXL progress thread (each would hold a core; applied by our
    connector and our vLLM plugin, :mod:`flowprefill.kv.vllm_plugin`, wherever FlowPrefill
    is installed beside vLLM; inert where it is not)."""
    spin = {VLLM_IDLE_SPIN_ENV: CPU_VLLM_IDLE_SPIN_S, NIXL_PROGRESS_THREAD_ENV: "0"} if cpu else {}
    return {**USAGE_STATS_OFF_ENV, **spin}


def gateway_process(
    launcher: Launcher,
    *,
    gateway_config_path: str,
    slo_table_path: str,
    port: int,
    host: str | None = None,
    drain_timeout_s: int | None = None,
) -> ProcessSpec:
    """``flowprefill serve-gateway`` with its ``gateway.json`` and the SLO table (reloaded
    when the file changes); ``drain_timeout_s``: how long open streams may take to finish
    on SIGTERM (the gateway's default when None)."""
    drain = () if drain_timeout_s is None else (DRAIN_TIMEOUT_FLAG, str(drain_timeout_s))
    return ProcessSpec(
        role=Role.GATEWAY,
        launcher=launcher.flowprefill,
        args=(
            "serve-gateway",
            "--config",
            gateway_config_path,
            "--slo-table",
            slo_table_path,
            *_listen(host, port),
            *drain,
        ),
        port=port,
        ready_path=READY_PATH,
    )


def fetch_model_argv(
    launcher: Launcher, uri: str, dest: str, *, tokenizer_only: bool = False
) -> list[str]:
    """``flowprefill fetch-model``: a pod's download step (an init container, no port),
    ``uri`` (``hf://``) into ``dest``; ``tokenizer_only`` for the gateway."""
    return [
        *launcher.flowprefill,
        "fetch-model",
        uri,
        "--dest",
        dest,
        *(["--tokenizer-only"] if tokenizer_only else []),
    ]
