"""``flowprefill serve-prefill``: one prefill instance over HTTP."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="engine.json (flowprefill.config.EngineConfig)")
    p.add_argument("--model", help="override model_path (local dir or built-in name)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--profile", help="override predictor_path (TTFT profile JSON)")
    p.add_argument("--kv-dir", help="directory for the KV hand-off to decode")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest accepted body")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish on SIGTERM")


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from rich.console import Console

    from flowprefill.backend import build_executor, load_engine_model, quick_profile
    from flowprefill.config import EngineConfig
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
    kv_sink = None
    if args.kv_dir:
        from flowprefill.server.kv_sink import directory_sink

        kv_sink = directory_sink(args.kv_dir, model.config)
    app = create_app(engine, kv_sink=kv_sink)
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
