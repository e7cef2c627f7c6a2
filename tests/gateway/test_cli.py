"""``serve-gateway``'s command line reaches the server: the drain bound of open streams."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowprefill import cli
from flowprefill.contracts import Endpoint, GatewayConfig, SLOTable
from flowprefill.models import named_model_dir


@pytest.mark.parametrize(("argv", "drain_s"), [([], 30.0), (["--drain-timeout", "300"], 300.0)])
def test_drain_timeout_bounds_uvicorns_graceful_shutdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], drain_s: float
) -> None:
    import uvicorn

    config = GatewayConfig(
        service="t",
        model_name="tiny",
        tokenizer_path=str(named_model_dir("tiny-llama", cache_dir=tmp_path / "models")),
        prefill=[Endpoint.at("p", "127.0.0.1", 9)],
        decode=[],
    )
    (tmp_path / "gateway.json").write_text(config.model_dump_json())
    (tmp_path / "slo-table.json").write_text(SLOTable.paper().model_dump_json())
    served: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(kw))
    files = [
        "--config",
        str(tmp_path / "gateway.json"),
        "--slo-table",
        str(tmp_path / "slo-table.json"),
    ]
    assert cli.main(["serve-gateway", *files, *argv]) == 0
    assert served[0]["timeout_graceful_shutdown"] == drain_s
