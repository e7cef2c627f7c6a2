"""``flowprefill up --decode-aware``: every prefill instance listens for beats, every decode
instance sends them (beat connector beside its KV connector); off, nothing changes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from flowprefill.contracts import EngineConfig, SLOTable
from flowprefill.contracts.beats import BEAT_CONNECTOR, SOCKET_KEY
from flowprefill.stack.decode_aware import beat_socket_path
from flowprefill.stack.up import StackPlan, add_arguments, plan_stack


def _plan(tmp_path: Path, *flags: str) -> StackPlan:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prefill", "2", "--decode", "2", *flags])
    return plan_stack(args, tmp_path / "m", tmp_path / "p.json", SLOTable.paper(), tmp_path)


def _engines(plan: StackPlan) -> list[EngineConfig]:
    return [EngineConfig.model_validate_json(plan.files[f"engine-{i}.json"]) for i in range(2)]


def _kv_config(plan: StackPlan, i: int) -> dict[str, object]:
    decode = next(c for c in plan.children if c.name == f"decode-{i}").process
    config = json.loads(decode.args[decode.args.index("--kv-transfer-config") + 1])
    assert isinstance(config, dict)
    return config


def test_off_by_default(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    assert all(e.decode_aware is None for e in _engines(plan))
    assert all(e.resolved_max_blocking_ms() == 100.0 for e in _engines(plan))
    assert _kv_config(plan, 0)["kv_connector"] == "NixlConnector"


@pytest.mark.parametrize("transport", ["nixl", "shared_dir", "http"])
def test_on_wires_beats_from_every_decode_to_every_prefill(tmp_path: Path, transport: str) -> None:
    plan = _plan(
        tmp_path, "--decode-aware", "--decode-aware-tbt", "0.2", "--kv-transport", transport
    )
    sockets = [beat_socket_path(tmp_path, i) for i in range(2)]
    engines = _engines(plan)
    for engine, sock in zip(engines, sockets, strict=True):
        assert engine.decode_aware is not None
        assert engine.decode_aware.socket_path == sock
        assert engine.decode_aware.tbt_target_s == 0.2
        # A park needs a checkpoint: operators split at a quarter of the target.
        assert engine.resolved_max_blocking_ms() == pytest.approx(50.0)
    for i in range(2):
        config = _kv_config(plan, i)
        assert config["kv_connector"] == "MultiConnector"
        extra = config["kv_connector_extra_config"]
        assert isinstance(extra, dict)
        kv, beats = extra["connectors"]
        assert kv["kv_role"] == "kv_consumer" and kv["kv_connector"] != BEAT_CONNECTOR
        assert beats["kv_connector"] == BEAT_CONNECTOR
        assert beats["kv_connector_extra_config"][SOCKET_KEY] == sockets


def test_an_explicit_blocking_bound_wins(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "--decode-aware", "--max-blocking-ms", "off")
    assert all(e.resolved_max_blocking_ms() is None for e in _engines(plan))


def test_no_decode_no_beats(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--decode", "0", "--decode-aware"])
    plan = plan_stack(args, tmp_path / "m", tmp_path / "p.json", SLOTable.paper(), tmp_path)
    assert EngineConfig.model_validate_json(plan.files["engine-0.json"]).decode_aware is None


def test_a_long_run_folder_gets_a_short_socket_path(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 120)
    path = beat_socket_path(deep, 3)
    assert len(path.encode()) <= 107 and path.endswith("-3.sock")
    assert beat_socket_path(deep, 3) == path  # the same folder, the same socket
    assert beat_socket_path(tmp_path, 0) == str(tmp_path / "beats-0.sock")
