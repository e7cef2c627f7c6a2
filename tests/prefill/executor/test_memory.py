"""What a parked task holds: measured from its thread's frames, bounded from the model."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from flowprefill.prefill.executor.memory import frames_held_bytes
from flowprefill.prefill.executor.pool import ExecutionPool
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.request import Request, Task
from tests.prefill.executor.helpers import random_prompts


class MeasureEveryCheckpoint:
    """A gate that never parks: it measures the task's own stack at each checkpoint."""

    def __init__(self, exclude: frozenset[tuple[str, int]]) -> None:
        self.exclude = exclude
        self.samples: list[int] = []

    def at_checkpoint(self, control: TaskControl) -> None:
        self.samples.append(frames_held_bytes(sys._getframe(), self.exclude))


@pytest.mark.parametrize(
    "kwargs", [{}, {"chunk_size": 64}, {"max_blocking_ms": 0.05}], ids=["whole", "chunked", "split"]
)
@pytest.mark.parametrize("lengths", [[300], [100, 57, 200]], ids=["one", "batch"])
def test_the_bound_holds_at_every_checkpoint(
    tiny_model: PreTrainedModel,
    make_executor: Callable[..., PreemptibleExecutor],
    kwargs: dict[str, Any],
    lengths: list[int],
) -> None:
    executor = make_executor(tiny_model, **kwargs)
    gate = MeasureEveryCheckpoint(executor._weights)
    control = TaskControl()
    control.gate = gate
    executor.run(random_prompts(lengths, executor.vocab_size, seed=3), control)
    bound = executor.estimate_parked_bytes(sum(lengths), len(lengths))
    assert gate.samples and max(gate.samples) <= bound
    # The measurement sees the KV cache: the last checkpoint holds at least the keys and
    # values of every layer but the last.
    kv = executor.footprint.kv_bytes_per_token * sum(lengths)
    assert gate.samples[-1] >= kv * (executor.num_layers - 1) // executor.num_layers


def test_weights_are_not_counted(
    tiny_models: dict[str, PreTrainedModel], make_executor: Callable[..., PreemptibleExecutor]
) -> None:
    executor = make_executor(tiny_models["llama"])
    exclude = executor._weights

    def views_and_weights() -> int:
        mine = torch.zeros(1000)
        held = (mine[10:], {"a": [mine]}, next(executor.model.parameters()))  # noqa: F841
        return frames_held_bytes(sys._getframe(), exclude)

    def nothing() -> int:
        return frames_held_bytes(sys._getframe(), exclude)

    # Views of one storage count once; a weight (a parameter of the model) not at all.
    assert views_and_weights() - nothing() == 4000


def test_the_pool_measures_a_parked_task_and_forgets_it_on_resume(
    tiny_models: dict[str, PreTrainedModel], make_executor: Callable[..., PreemptibleExecutor]
) -> None:
    executor = make_executor(tiny_models["llama"])
    prompt = random_prompts([400], executor.vocab_size, seed=4)
    done = threading.Event()
    pool: ExecutionPool[Any] = ExecutionPool(
        lambda task, control: executor.run(prompt, control),
        lambda task, result, error: done.set(),
    )
    task = Task([Request.create("r", arrival_s=0.0, ttft_slo_s=1.0, num_tokens=400)])
    pool.submit(task)
    assert pool.preempt(task).parked
    held = pool.held_bytes(task)
    assert held is not None and 0 < held <= executor.estimate_parked_bytes(400)
    assert pool.parked_bytes == held
    pool.resume(task)
    assert pool.parked_bytes == 0
    assert done.wait(30.0)
    assert pool.held_bytes(task) is None  # finished: nothing parked
    pool.release(task)
