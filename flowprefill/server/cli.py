"""``flowprefill serve-prefill``: one prefill instance over HTTP."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowprefill.server.kv_sink import DirectorySink

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="engine.json (flowprefill.config.EngineConfig)")
    p.add_argument("--model", help="override model_path (local dir or built-in name)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--profile", help="override predictor_path (TTFT profile JSON)")
    p.add_argument(
        "--kv-dir",
        help="directory for the KV hand-off to decode (with --kv-transport http: this "
        "instance's own; default $FLOWPREFILL_KV_DIR or /tmp/flowprefill-kv)",
    )
    p.add_argument(
        "--kv-transport",
        choices=["shared_dir", "http"],
        default="shared_dir",
        help="shared_dir: decode reads --kv-dir (a shared volume); http: this server serves "
        "hand-offs at /v1/kv/<id> and decode pulls them",
    )
    p.add_argument(
        "--kv-advertise-url",
        help="base URL decode uses to reach this server (http transport); default "
        "$FLOWPREFILL_KV_ADVERTISE_URL, else http://<host>:<port> (a wildcard host: the "
        "address the hostname resolves to, in a pod the pod IP)",
    )
    p.add_argument(
        "--kv-max-age",
        type=float,
        default=600.0,
        help="seconds after which unconsumed hand-offs are swept",
    )
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest accepted body")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish on SIGTERM")


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from rich.console import Console

    from flowprefill.backend import build_executor, load_engine_model, quick_profile
    from flowprefill.contracts import EngineConfig
    from flowprefill.engine import PrefillEngine
    from flowprefill.predictor.model import TTFTPredictor
    from flowprefill.server.errors import BodySizeLimit
    from flowprefill.server.prefill import create_app

    config = EngineConfig.load(args.config) if args.config else EngineConfig()
    updates = {k: v for k, v in (("model_path", args.model), ("predictor_path", args.profile)) if v}
    config = config.model_copy(update=updates)
    model = load_engine_model(config)
    executor = build_executor(config, model)
    predictor = (
        TTFTPredictor.load(config.predictor_path)
        if config.predictor_path
        else quick_profile(executor, Console(stderr=True), model_name=config.model_path)
    )
    engine = PrefillEngine(
        executor,
        predictor,
        policy=config.policy,
        batching=config.batching,
        token_budget=config.batch_token_budget,
    )
    kv_sink = kv_handoff(args, model.config)
    # /v1/kv/<id>: decode pulls hand-offs from it (http); the gateway deletes the ones
    # decode will not load through it (both transports).
    kv_store = kv_sink.transport if kv_sink is not None else None
    app = create_app(engine, kv_sink=kv_sink, kv_store=kv_store)
    log.info(
        "prefill instance: %s, granularity %s, policy %s, port %d",
        config.model_path,
        config.granularity,
        config.policy,
        args.port,
    )
    uvicorn.run(
        BodySizeLimit(app, int(args.max_body_mb * 2**20)),
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=int(args.drain_timeout),
        log_level="info",
    )
    return 0


def kv_handoff(args: argparse.Namespace, model_config: Any) -> DirectorySink | None:
    """Where this instance writes KV hand-offs for decode, or None (no --kv-dir and the
    shared_dir transport: decode recomputes)."""
    if not (args.kv_dir or args.kv_transport == "http"):
        return None
    from flowprefill.kv import default_storage_path
    from flowprefill.server.kv_sink import advertise_url, directory_sink

    source = None
    if args.kv_transport == "http":
        source = advertise_url(args.host, args.port, args.kv_advertise_url)
        if args.host in ("0.0.0.0", "::") and "://127." in source:
            log.warning(
                "KV hand-offs advertised as %s, which other machines cannot reach: set "
                "--kv-advertise-url or $FLOWPREFILL_KV_ADVERTISE_URL (e.g. the pod IP)",
                source,
            )
    sink = directory_sink(
        args.kv_dir or default_storage_path(),
        model_config,
        max_age_s=args.kv_max_age,
        source=source,
    )
    if source is not None:
        log.info("KV hand-offs in %s, served to decode as %s", sink.transport.root, source)
    else:
        log.info("KV hand-offs in shared directory %s", sink.transport.root)
    return sink
