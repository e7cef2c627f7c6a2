"""Fixtures: a two-rank (gloo) instance of each tiny model, and its one-rank reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flowprefill.contracts import EngineConfig
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.factory import build_executor
from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend

FAMILIES = ("llama", "qwen2", "qwen3-moe")


def tp_config(family: str, **overrides: object) -> EngineConfig:
    return EngineConfig.model_validate(
        {"model_path": f"tiny-{family}", "tp_size": 2, "num_threads": 1, **overrides}
    )


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def tp2(family: str) -> Iterator[TPPrefillBackend]:
    backend = TPPrefillBackend(tp_config(family))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def tp1(family: str) -> Iterator[PreemptibleExecutor]:
    with build_executor(tp_config(family, tp_size=1)) as executor:
        yield executor
