from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from flowprefill.models import build_model
from flowprefill.prefill.executor.runner import PreemptibleExecutor

FAMILIES = ("llama", "qwen2", "qwen3-moe")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a shared 2-core machine
    # OpenMP workers spin-waiting for a busy core make every op many times slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, PreTrainedModel]:
    return {family: build_model(family, "tiny", seed=1) for family in FAMILIES}


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def tiny_model(tiny_models: dict[str, PreTrainedModel], family: str) -> PreTrainedModel:
    return tiny_models[family]


@pytest.fixture
def make_executor() -> Iterator[Callable[..., PreemptibleExecutor]]:
    """Build executors on shared models; each closes (unhooks) at teardown."""
    made: list[PreemptibleExecutor] = []

    def make(model: PreTrainedModel, **kwargs: Any) -> PreemptibleExecutor:
        executor = PreemptibleExecutor(model, **kwargs)
        made.append(executor)
        return executor

    yield make
    for executor in made:
        executor.close()
