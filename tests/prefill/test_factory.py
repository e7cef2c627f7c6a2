"""Wiring an EngineConfig into an executor: the config's settings reach the executor."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from flowprefill.contracts import EngineConfig
from flowprefill.contracts.deployment import KERNELS_ENV
from flowprefill.prefill.factory import build_executor


@pytest.fixture(autouse=True)
def _model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWPREFILL_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.delenv(KERNELS_ENV, raising=False)


@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_config_chooses_the_executor_kernels(kernels: str) -> None:
    config = EngineConfig(model_path="tiny-llama", kernels=kernels, chunk_size=64)
    with build_executor(config) as executor:
        assert executor.kernels == kernels
        assert (executor._linears.num_packed > 0) == (kernels == "fast")
        assert executor.chunk_size == 64


def test_unset_kernels_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNELS_ENV, "reference")
    with build_executor(EngineConfig(model_path="tiny-llama")) as executor:
        assert executor.kernels == "reference"


def test_unknown_kernels_name_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="kernels"):
        EngineConfig(kernels="turbo")


def test_tensor_parallel_beyond_one_machine_is_refused_with_a_pointer_to_the_docs() -> None:
    # Refused where the config is read, before any model loads or pod starts.
    assert EngineConfig(model_path="tiny-llama", tp_size=8).tp_size == 8
    with pytest.raises(ValidationError, match=r"tp_size=9(.|\n)*docs/executor\.md"):
        EngineConfig(model_path="tiny-llama", tp_size=9)


@pytest.mark.parametrize("mode", ["every_check", "run_ahead", "on_preempt"])
def test_config_chooses_the_device_sync_mode(mode: str) -> None:
    with build_executor(EngineConfig(device_sync=mode)) as executor:
        assert executor.sync_mode == mode
    assert EngineConfig().device_sync == "every_check"


def test_unknown_device_sync_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="device_sync"):
        EngineConfig(device_sync="sometimes")
