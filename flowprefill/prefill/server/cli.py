"""``flowprefill serve-prefill``: one prefill instance over HTTP."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from flowprefill.contracts import EngineConfig, KVHandoffSettings, KVTransport
from flowprefill.contracts.deployment import (
    DEFAULT_KV_DIR,
    KV_ADVERTISE_URL_ENV,
    KV_DIR_ENV,
    PREFILL_KV_PORT,
    PREFILL_PORT,
)
from flowprefill.contracts.engine import DecodeAwareSettings, max_blocking_arg
from flowprefill.contracts.prefill_api import COLOCATED_DECODE_URL_FLAG, check_decode_url
from flowprefill.contracts.processes import DRAIN_TIMEOUT_FLAG
from flowprefill.web.limits import add_client_limit_arguments

if TYPE_CHECKING:
    from flowprefill.prefill.engine import Predictor, PrefillBackend, PrefillEngine
    from flowprefill.prefill.server.kv_sink import DirectorySink
    from flowprefill.prefill.server.nixl_sink import NixlSink

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="engine.json (flowprefill.contracts.EngineConfig)")
    p.add_argument("--model", help="override model_path (local dir or built-in name)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=PREFILL_PORT, help="the prefill API's port")
    p.add_argument(
        "--kv-port",
        type=int,
        default=PREFILL_KV_PORT,
        help="with the http KV transport: the port decode pulls hand-offs from "
        "(GET|HEAD|DELETE /v1/kv/<id>; not served on --port, so that a network policy can "
        "open it to decode alone)",
    )
    p.add_argument("--profile", help="override predictor_path (TTFT profile JSON)")
    # The KV flags override engine.json's "kv" section (for running a server by hand).
    p.add_argument(
        "--kv-dir",
        help="override kv.dir: the hand-off directory (with --kv-transport http: this "
        f"instance's own; default ${KV_DIR_ENV} or {DEFAULT_KV_DIR})",
    )
    p.add_argument(
        "--kv-transport",
        type=KVTransport.parse,
        choices=list(KVTransport),
        help="override kv.transport. shared_dir: decode reads the hand-off directory (a shared "
        "volume); http: this server serves hand-offs at /v1/kv/<id> and decode pulls them",
    )
    p.add_argument(
        "--kv-advertise-url",
        help="override kv.advertise_url: the base URL decode uses to reach this server's KV "
        f"port (http transport); default ${KV_ADVERTISE_URL_ENV}, else http://<host>:<kv-port> "
        "(a wildcard host: the address the hostname resolves to, in a pod the pod IP)",
    )
    p.add_argument(
        "--kv-max-age",
        type=float,
        help="override kv.max_age_s: seconds after which unconsumed hand-offs are swept",
    )
    p.add_argument(
        "--max-blocking-ms",
        type=max_blocking_arg,
        help="override max_blocking_ms: split operators predicted to run longer between two "
        "checkpoints (a number of ms, or off)",
    )
    p.add_argument(
        "--parked-memory-mb",
        type=float,
        help="override parked_memory_bytes (MiB): what preempted tasks may hold; 0 never preempts",
    )
    p.add_argument(
        "--decode-aware-socket",
        help="turn on decode-aware preemption (override decode_aware): listen for decode's "
        "step beats at this Unix socket path and park the running prefill for decode steps "
        "whose TBT target is at risk (docs/executor.md)",
    )
    p.add_argument(
        "--decode-aware-tbt",
        type=float,
        help="with decode-aware preemption: the TBT target (s) to protect (default "
        "decode_aware.tbt_target_s, else the paper's tightest, 0.1)",
    )
    add_client_limit_arguments(p, max_body_mb=16.0)
    p.add_argument(
        "--default-ttft-slo",
        type=float,
        default=1.0,
        help="nixl transport: the TTFT target (s) of vLLM-style P/D requests at "
        "/v1/completions that name none (body ttft_slo_s, or header x-llm-d-slo-ttft-ms / "
        "x-slo-ttft-ms)",
    )
    p.add_argument(
        DRAIN_TIMEOUT_FLAG, type=float, default=30.0, help="seconds to finish on SIGTERM"
    )
    p.add_argument(
        COLOCATED_DECODE_URL_FLAG,
        type=decode_url_arg,
        help="a colocated instance (prefill beside its own vLLM, one pod of a colocated "
        "pool): that vLLM's base URL as the gateway reaches it (in a pod http://<pod IP>:"
        "8200), named in every answer so the gateway decodes the request there",
    )


def decode_url_arg(text: str) -> str:
    """argparse type of :data:`COLOCATED_DECODE_URL_FLAG`: ``http(s)://host:port``."""
    try:
        return check_decode_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_config(args: argparse.Namespace) -> EngineConfig:
    """engine.json (or the defaults) with the command line's overrides applied."""
    config = EngineConfig.load(args.config) if args.config else EngineConfig()
    updates: dict[str, Any] = {
        k: v
        for k, v in (
            ("model_path", args.model),
            ("predictor_path", args.profile),
            ("max_blocking_ms", args.max_blocking_ms),
        )
        if v
    }
    if args.parked_memory_mb is not None:  # outside the filter above: 0 is a valid budget
        if args.parked_memory_mb < 0:
            raise SystemExit(f"--parked-memory-mb must be >= 0, got {args.parked_memory_mb:g}")
        updates["parked_memory_bytes"] = int(args.parked_memory_mb * 2**20)
    kv_updates = {
        k: v
        for k, v in (
            ("dir", args.kv_dir),
            ("transport", args.kv_transport),
            ("advertise_url", args.kv_advertise_url),
            ("max_age_s", args.kv_max_age),
        )
        if v is not None
    }
    if kv_updates:
        base = config.kv.model_dump() if config.kv else {}
        updates["kv"] = KVHandoffSettings.model_validate({**base, **kv_updates})
    if args.decode_aware_socket or args.decode_aware_tbt is not None:
        base = config.decode_aware.model_dump() if config.decode_aware else {}
        if args.decode_aware_socket:
            base["socket_path"] = args.decode_aware_socket
        if args.decode_aware_tbt is not None:
            base["tbt_target_s"] = args.decode_aware_tbt
        if "socket_path" not in base:
            raise SystemExit("--decode-aware-tbt needs --decode-aware-socket (or engine.json's)")
        try:
            updates["decode_aware"] = DecodeAwareSettings.model_validate(base)
        except ValidationError as e:
            raise SystemExit(f"decode-aware preemption: {e}") from None
    return config.model_copy(update=updates)


def build_engine(
    config: EngineConfig, backend: PrefillBackend, predictor: Predictor
) -> PrefillEngine:
    """The prefill engine as engine.json describes it (every scheduling field of
    :class:`EngineConfig` the engine takes goes through here)."""
    from flowprefill.prefill.engine import PrefillEngine

    return PrefillEngine(
        backend,
        predictor,
        policy=config.policy,
        batching=config.batching,
        token_budget=config.batch_token_budget,
        parked_memory_bytes=config.parked_memory_bytes,
        decode_aware=config.decode_aware,
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from flowprefill.prefill.factory import build_backend, model_config_of, quick_profile
    from flowprefill.prefill.predictor.model import TTFTPredictor
    from flowprefill.prefill.server.kv_http import add_discard_route, create_kv_app
    from flowprefill.prefill.server.listeners import ClientLimits, listener, serve
    from flowprefill.prefill.server.pd_api import add_pd_route
    from flowprefill.prefill.server.prefill import create_app
    from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend
    from flowprefill.web.gc_tuning import freeze_startup

    config = resolve_config(args)
    kv_http = config.kv is not None and config.kv.transport is KVTransport.HTTP
    closing = contextlib.ExitStack()
    if kv_http and args.kv_port == args.port:
        raise SystemExit(f"--kv-port must differ from --port (both {args.port})")
    backend = build_backend(config)
    tp = backend if isinstance(backend, TPPrefillBackend) else None
    try:
        predictor = (
            TTFTPredictor.load(config.predictor_path)
            if config.predictor_path
            else quick_profile(backend, Console(stderr=True), model_name=config.model_path)
        )
        engine = build_engine(config, backend, predictor)
        model_config = model_config_of(backend)
        if config.kv is not None and config.kv.transport is KVTransport.NIXL:
            nixl = nixl_handoff(config, args.host, backend, model_config)
            closing.callback(nixl.close)
            engine.metrics.watch_kv(nixl.held_bytes, nixl.budget_bytes)
            app = create_app(engine, kv_sink=nixl, decode_url=args.colocated_decode_url)
            add_discard_route(app, nixl.discard)
            add_pd_route(
                app,
                engine,
                nixl,
                tokenizer=functools.partial(load_tokenizer, config.model_path),
                model_name=config.model_path,
                default_ttft_slo_s=args.default_ttft_slo,
            )
        else:
            kv_sink = kv_handoff(config.kv, args.host, args.kv_port, model_config)
            if kv_sink is not None and kv_sink.budget_bytes is not None:
                engine.metrics.watch_kv(kv_sink.held_bytes, kv_sink.budget_bytes)
            # The gateway deletes hand-offs decode will not load through the main port
            # (both transports); decode reads (http) on the KV port alone.
            kv_store = kv_sink.transport if kv_sink is not None else None
            kv_url = kv_sink.source if kv_sink is not None else None
            app = create_app(
                engine,
                kv_sink=kv_sink,
                kv_store=kv_store,
                kv_url=kv_url,
                decode_url=args.colocated_decode_url,
            )
        log.info(
            "prefill instance: %s, granularity %s, policy %s, tp_size %d, port %d%s%s",
            config.model_path,
            config.granularity,
            config.policy,
            config.tp_size,
            args.port,
            f", KV port {args.kv_port}" if kv_http else "",
            f", colocated with decode {args.colocated_decode_url}"
            if args.colocated_decode_url
            else "",
        )
        limits = ClientLimits(
            max_body_bytes=int(args.max_body_mb * 2**20),
            body_timeout_s=args.body_timeout,
            header_timeout_s=args.header_timeout,
            drain_timeout_s=args.drain_timeout,
        )
        server = listener(app, args.host, args.port, limits)
        kv_server = None
        if kv_http and kv_store is not None:
            kv_server = listener(create_kv_app(kv_store), args.host, args.kv_port, limits)
        if tp is not None:

            def rank_failed(error: BaseException) -> None:
                # In-flight requests get a 503 naming the rank, /ready fails, and the
                # server exits non-zero so that the pod restarts.
                engine.fail(error)
                server.should_exit = True

            tp.group.on_failure(rank_failed)
        # The model, torch and the app live as long as the process: out of the full
        # collections that would otherwise hold the GIL for their whole scan while the
        # executor waits at a checkpoint (flowprefill.web.gc_tuning).
        freeze_startup()
        serve(server, kv_server)
    finally:
        closing.close()
        backend.close()
    return 1 if tp is not None and tp.group.failure is not None else 0


def nixl_handoff(config: EngineConfig, host: str, backend: Any, model_config: Any) -> NixlSink:
    """This instance as a NIXL producer (``nixl`` transport), rank 0 on its device."""
    from flowprefill.prefill.server.nixl_sink import nixl_sink
    from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend

    assert config.kv is not None
    group = backend.group if isinstance(backend, TPPrefillBackend) else None
    return nixl_sink(
        config.kv.nixl,
        model_path=config.model_path,
        model_config=model_config,
        dtype=config.dtype,
        device=config.device,
        host=host,
        # Tensor parallelism: every rank serves its own heads (prefill/tp/kv_ranks.py).
        peers=group.kv_peers if group is not None else None,
        publish_peers=group.publish_kv if group is not None else None,
        peer_notifications=group.drain_kv_notifications if group is not None else None,
    )


def load_tokenizer(model_path: str) -> Any:
    """The model's tokenizer (for P/D requests that send text)."""
    from transformers import AutoTokenizer

    from flowprefill.models.loader import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(model_path))


def kv_handoff(
    kv: KVHandoffSettings | None, host: str, kv_port: int, model_config: Any
) -> DirectorySink | None:
    """Where this instance writes KV hand-offs for decode, or None (no ``kv`` settings:
    decode recomputes). With the ``http`` transport the answers name the KV listener
    (``kv_port`` on ``host``, unless an advertised URL says otherwise) as their source."""
    if kv is None:
        return None
    from flowprefill.prefill.server.kv_sink import advertise_url, directory_sink

    source = None
    if kv.transport is KVTransport.HTTP:
        source = advertise_url(host, kv_port, kv.advertise_url)
        if host in ("0.0.0.0", "::") and "://127." in source:
            log.warning(
                "KV hand-offs advertised as %s, which other machines cannot reach: set "
                "kv.advertise_url or $%s (e.g. the pod IP)",
                source,
                KV_ADVERTISE_URL_ENV,
            )
    sink = directory_sink(
        kv.resolved_dir,
        model_config,
        max_age_s=kv.max_age_s,
        source=source,
        budget_bytes=int(kv.budget_mb * 2**20),
    )
    if source is not None:
        log.info("KV hand-offs in %s, served to decode as %s", sink.transport.root, source)
    else:
        log.info("KV hand-offs in shared directory %s", sink.transport.root)
    return sink
