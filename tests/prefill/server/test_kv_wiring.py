"""``serve-prefill``'s KV hand-off wiring: which directory, what the answer advertises, and
that ``DELETE /v1/kv/<id>`` is served on the main port for both transports (the gateway
deletes hand-offs decode will not load through it) while reads are not."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest
import torch

from flowprefill.contracts import EngineConfig
from flowprefill.contracts.deployment import PREFILL_KV_PORT
from flowprefill.contracts.engine import DEFAULT_KV_BUDGET_MB
from flowprefill.models import load_model, named_model_dir
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.cli import add_arguments, build_engine, kv_handoff, resolve_config
from flowprefill.prefill.server.prefill import create_app
from tests.helpers import serve_in_thread


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_no_kv_settings_means_no_handoff() -> None:
    args = _args()
    assert args.kv_port == PREFILL_KV_PORT
    assert kv_handoff(resolve_config(args).kv, args.host, args.kv_port, model_config=None) is None


@pytest.mark.parametrize("transport", ["shared_dir", "http"])
def test_handoffs_are_written_and_deletable_through_the_server(
    tmp_path: Path, transport: str
) -> None:
    torch.manual_seed(0)
    model = load_model(named_model_dir("tiny-llama", cache_dir=tmp_path / "models"))
    argv = ["--kv-dir", str(tmp_path / "kv"), "--kv-transport", transport]
    argv += ["--host", "127.0.0.1", "--port", "8123", "--kv-port", "8124"]
    args = _args(*argv)
    sink = kv_handoff(resolve_config(args).kv, args.host, args.kv_port, model.config)
    assert sink is not None and sink.transport.root == tmp_path / "kv"
    assert sink.budget_bytes == int(DEFAULT_KV_BUDGET_MB * 2**20)  # engine.json's kv.budget_mb
    with PreemptibleExecutor(model, granularity="operator") as executor:
        engine = PrefillEngine(executor, TTFTPredictor.linear(1e-5))
        app = create_app(engine, kv_sink=sink, kv_store=sink.transport, kv_url=sink.source)
        with serve_in_thread(app) as url:
            body = {"request_id": "w1", "prompt_token_ids": list(range(1, 40))}
            r = httpx.post(f"{url}/v1/prefill", json={**body, "ttft_slo_s": 60.0})
            assert r.status_code == 200, r.text
            params = r.json()["kv_transfer_params"]["flowprefill"]
            assert params["handoff_id"] == "w1"
            # http advertises the KV listener decode pulls from; shared_dir names no source.
            assert params.get("source") == (
                "http://127.0.0.1:8124" if transport == "http" else None
            )
            assert (tmp_path / "kv" / "w1.kv.safetensors").is_file()
            # Reads are not served on the main port; the answer says where they are.
            for method in ("GET", "HEAD"):
                r = httpx.request(method, f"{url}/v1/kv/w1")
                assert r.status_code == 405 and r.headers["allow"] == "DELETE", method
            message = httpx.get(f"{url}/v1/kv/w1").json()["error"]["message"]
            where = "http://127.0.0.1:8124/v1/kv/" if transport == "http" else "shared_dir"
            assert where in message, message
            assert httpx.delete(f"{url}/v1/kv/w1").json() == {"handoff_id": "w1", "deleted": True}
            assert not (tmp_path / "kv" / "w1.kv.safetensors").exists()
            assert httpx.delete(f"{url}/v1/kv/w1").status_code == 404


def test_command_line_overrides_engine_json_kv_section(tmp_path: Path) -> None:
    from flowprefill.contracts import EngineConfig, KVHandoffSettings, KVTransport

    config = EngineConfig(kv=KVHandoffSettings(transport="http", dir="/kv", max_age_s=60))
    path = tmp_path / "engine.json"
    path.write_text(config.model_dump_json())
    kv = resolve_config(_args("--config", str(path), "--kv-max-age", "5")).kv
    assert kv == KVHandoffSettings(transport=KVTransport.HTTP, dir="/kv", max_age_s=5)
    assert resolve_config(_args("--config", str(path))).kv == config.kv


def test_engine_json_parked_memory_budget_reaches_the_engine(tmp_path: Path) -> None:
    """serve-prefill builds its engine from engine.json: the parked-memory budget (and its
    command-line override, where 0 is a valid budget) is the one the scheduler enforces."""
    path = tmp_path / "engine.json"
    path.write_text(EngineConfig(parked_memory_bytes=123_456).model_dump_json())
    assert resolve_config(_args("--config", str(path))).parked_memory_bytes == 123_456
    config = resolve_config(_args("--config", str(path), "--parked-memory-mb", "0"))
    assert config.parked_memory_bytes == 0
    with pytest.raises(SystemExit, match="parked-memory-mb"):
        resolve_config(_args("--parked-memory-mb", "-1"))

    torch.manual_seed(0)
    model = load_model(named_model_dir("tiny-llama", cache_dir=tmp_path / "models"))
    with PreemptibleExecutor(model, granularity="operator") as executor:
        for budget in (None, 0, 4096):
            config = EngineConfig(parked_memory_bytes=budget)
            engine = build_engine(config, executor, TTFTPredictor.linear(1e-5))
            try:
                assert engine.scheduler.parked_memory.budget_bytes == budget
            finally:
                engine.close()
