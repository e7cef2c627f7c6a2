"""``flowprefill serve-gateway``: the OpenAI-compatible front door."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from flowprefill.contracts import GatewayConfig
from flowprefill.contracts.deployment import GATEWAY_PORT
from flowprefill.contracts.processes import DRAIN_TIMEOUT_FLAG
from flowprefill.web.limits import add_client_limit_arguments

if TYPE_CHECKING:
    from flowprefill.gateway.app import GatewayState


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="gateway.json (flowprefill.contracts)")
    p.add_argument("--slo-table", required=True, help="slo-table.json; reloaded when it changes")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=GATEWAY_PORT)
    add_client_limit_arguments(p, max_body_mb=32.0)
    p.add_argument("--upstream-timeout", type=float, default=600.0, help="seconds")
    p.add_argument(
        DRAIN_TIMEOUT_FLAG,
        type=float,
        default=30.0,
        help="seconds open streams may take to finish on SIGTERM before they are cut",
    )


def build_state(
    config: GatewayConfig,
    slo_table: str | Path,
    upstream_timeout_s: float = 600.0,
) -> GatewayState:
    """The gateway's state for ``config``: the model directory's tokenizer and config read
    without transformers (:mod:`flowprefill.gateway.model_files`), the SLO table file, the
    pools and upstream clients. Raises ValueError when neither ``max_model_len`` nor the
    model's config.json gives the longest prompt."""
    from flowprefill.gateway.app import GatewayState
    from flowprefill.gateway.classify import SLOTableFile
    from flowprefill.gateway.model_files import FileTokenizer, read_model_config
    from flowprefill.gateway.routing import InstancePool
    from flowprefill.gateway.tokens import Tokenizer
    from flowprefill.gateway.upstream import DecodeClient, PrefillClient, UpstreamHTTP
    from flowprefill.prefill.predictor.model import TTFTPredictor

    model_dir = _model_dir(config.tokenizer_path or config.model_name)
    file_tok = FileTokenizer.from_dir(model_dir)
    model_config = read_model_config(model_dir)
    max_len = config.max_model_len or model_config.max_position_embeddings
    if max_len is None:
        raise ValueError(
            f"{model_dir}/config.json gives no max_position_embeddings: set max_model_len "
            "in the gateway config"
        )
    eos_ids = set(model_config.eos_token_ids)
    if file_tok.eos_token_id is not None:
        eos_ids.add(file_tok.eos_token_id)
    # Ids the model embeds or the tokenizer knows: the larger, as vLLM checks prompts.
    vocab_size = max(len(file_tok), model_config.vocab_size or 0)
    predict = TTFTPredictor.load(config.predictor_path).predict_s if config.predictor_path else None
    client = UpstreamHTTP(upstream_timeout_s, connect_timeout_s=5.0)
    decode_urls = [e.url for e in config.decode]
    return GatewayState(
        model_name=config.model_name,
        tokenizer=Tokenizer(file_tok, max_len, eos_ids, vocab_size=vocab_size),
        slo_file=SLOTableFile(slo_table),
        prefill_pool=InstancePool(
            "prefill",
            [e.url for e in config.prefill],
            policy=config.prefill_routing,
            predict_s=predict,
            overload=config.overload,
        ),
        decode_pool=InstancePool(
            "decode", decode_urls, policy=config.decode_routing, predict_s=predict
        )
        if decode_urls
        else None,
        prefill_client=PrefillClient(client),
        decode_client=DecodeClient(client, model=str(model_dir)) if decode_urls else None,
        health_probe=config.health_probe,
    )


def _model_dir(path_or_name: str) -> Path:
    """A local directory as it is (what the gateway image is given); a built-in model name
    through :func:`flowprefill.models.resolve_model_path`, which builds the model on first
    use and so needs torch."""
    if Path(path_or_name).is_dir():
        return Path(path_or_name)
    from flowprefill.models import resolve_model_path

    return resolve_model_path(path_or_name)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from flowprefill.gateway.access_log import log_config
    from flowprefill.gateway.app import create_gateway_app
    from flowprefill.web.errors import BodySizeLimit
    from flowprefill.web.gc_tuning import GATEWAY_YOUNG_THRESHOLD, freeze_startup
    from flowprefill.web.limits import uvicorn_options

    config = GatewayConfig.model_validate_json(Path(args.config).read_text())
    state = build_state(config, args.slo_table, args.upstream_timeout)
    limit = int(args.max_body_mb * 2**20)
    app = BodySizeLimit(create_gateway_app(state), limit, args.body_timeout)
    freeze_startup(GATEWAY_YOUNG_THRESHOLD)  # what was built so far lives as long as the process
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        # uvicorn's logging, its access lines formatted at less cost (same text).
        log_config=log_config(),
        timeout_graceful_shutdown=args.drain_timeout,
        # Coalesced writes: a stream's events that are ready together leave in one write.
        **uvicorn_options(args.header_timeout, coalesce_writes=True),
    )
    return 0
