"""Fixtures of the benchmark smoke tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for the smoke tests that start vLLM: they need ``demo-llama`` (vLLM's
    CPU attention does not take tiny-llama's head size), which is built once, by the first
    script that asks for it, rather than once per test."""
    return tmp_path_factory.mktemp("demo-models")
