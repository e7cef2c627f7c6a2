"""FlowPrefill's vLLM plugin: declared where vLLM looks, inert without its variables, and
with them NIXL agents vLLM configures start without the spinning progress thread."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

import pytest

from flowprefill.contracts.deployment import VLLM_IDLE_SPIN_ENV
from flowprefill.contracts.names import KVTransport
from flowprefill.contracts.nixl import NIXL_PROGRESS_THREAD_ENV
from flowprefill.contracts.processes import Launcher, decode_process
from flowprefill.kv import vllm_plugin

needs_vllm_and_nixl = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None,
    reason="vLLM and nixl are not installed (pip install -e '.[decode]')",
)


def test_declared_as_a_vllm_general_plugin() -> None:
    (entry,) = [
        e
        for e in importlib.metadata.entry_points(group="vllm.general_plugins")
        if e.name == "flowprefill"
    ]
    assert entry.load() is vllm_plugin.register


@pytest.fixture
def nixl_utils(monkeypatch: pytest.MonkeyPatch) -> Any:
    import vllm.distributed.nixl_utils as module

    # Resolve vLLM's lazy attribute, and put the original back after the test.
    monkeypatch.setattr(module, "nixl_agent_config", module.nixl_agent_config)
    return module


@needs_vllm_and_nixl
def test_without_its_variable_nixl_is_left_alone(
    nixl_utils: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(NIXL_PROGRESS_THREAD_ENV, raising=False)
    before = nixl_utils.nixl_agent_config
    vllm_plugin.register()
    assert nixl_utils.nixl_agent_config is before
    assert nixl_utils.nixl_agent_config().enable_pthread is True  # NIXL's default


@needs_vllm_and_nixl
def test_variable_zero_turns_the_progress_thread_off(
    nixl_utils: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NIXL_PROGRESS_THREAD_ENV, "0")
    vllm_plugin.register()
    vllm_plugin.register()  # idempotent: wrapped once
    config = nixl_utils.nixl_agent_config
    # as vLLM's NixlConnector worker builds its config
    assert config(num_threads=4, capture_telemetry=True).enable_pthread is False
    assert config(num_threads=4, capture_telemetry=True).num_threads == 4
    assert config(enable_prog_thread=True).enable_pthread is True  # explicit wins


@pytest.mark.parametrize("cpu", [True, False])
def test_cpu_decode_processes_ask_for_it_gpu_ones_do_not(cpu: bool) -> None:
    for transport in (KVTransport.NIXL, KVTransport.HTTP):
        spec = decode_process(
            Launcher.local(), model_path="/m", port=8000, kv_transport=transport, cpu=cpu
        )
        assert (spec.env.get(NIXL_PROGRESS_THREAD_ENV) == "0") is cpu, (transport, spec.env)
        assert (VLLM_IDLE_SPIN_ENV in spec.env) is cpu
