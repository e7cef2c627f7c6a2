"""A preempted-and-resumed prefill is bit-identical to an uninterrupted one (float32)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
from transformers import PreTrainedModel

from flowprefill.errors import TaskCancelledError
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from tests.prefill.executor.helpers import (
    TIMEOUT_S,
    StopAt,
    TaskThread,
    assert_bit_identical,
    random_prompts,
)

MakeExecutor = Callable[..., PreemptibleExecutor]


@pytest.mark.parametrize("granularity", ["operator", "layer"])
@pytest.mark.parametrize("chunk_size", [None, 16])
def test_nested_preemptions_are_bit_identical(
    tiny_model: PreTrainedModel,
    make_executor: MakeExecutor,
    granularity: str,
    chunk_size: int | None,
) -> None:
    """A is preempted by B, B by C; C finishes, B resumes and finishes, A resumes, is
    preempted again by D, and finishes. Every output equals its solo run exactly."""
    executor = make_executor(tiny_model, granularity=granularity, chunk_size=chunk_size)
    vocab = executor.vocab_size
    prompts_a = random_prompts([37, 23], vocab, seed=1)  # a batch of two
    prompts_b = random_prompts([41], vocab, seed=2)
    prompts_c = random_prompts([11, 29, 5], vocab, seed=3)
    prompts_d = random_prompts([19], vocab, seed=4)
    solo = {
        name: executor.prefill(p)
        for name, p in [("a", prompts_a), ("b", prompts_b), ("c", prompts_c), ("d", prompts_d)]
    }

    expected_a = executor.expected_checkpoints([37, 23])
    first_a, second_a = 1 + expected_a // 4, expected_a  # early, and after the last layer
    # With chunking, park B exactly at the first chunk boundary.
    stop_b = executor.num_checkpoints_per_forward + 1 if chunk_size else 2
    a = TaskThread(executor, prompts_a, StopAt("A", at=[first_a, second_a])).start()
    a_control = a.control
    assert isinstance(a_control, StopAt)
    a_control.preempt_at(first_a)

    b = TaskThread(executor, prompts_b, StopAt("B", at=[stop_b])).start()
    b_control = b.control
    assert isinstance(b_control, StopAt)
    b_control.preempt_at(stop_b)

    c = TaskThread(executor, prompts_c, TaskControl("C")).start()
    assert_bit_identical(c.join(), solo["c"])

    b_control.resume()
    assert_bit_identical(b.join(), solo["b"])

    a_control.resume()
    a_control.preempt_at(second_a)
    d = TaskThread(executor, prompts_d, TaskControl("D")).start()
    assert_bit_identical(d.join(), solo["d"])
    a_control.resume()
    assert_bit_identical(a.join(), solo["a"])
    assert a_control.num_checkpoints == expected_a
    assert a_control.progress == 1.0


def test_preemption_at_random_moments_is_bit_identical(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor
) -> None:
    """A scheduler thread preempts and resumes at random times, racing the task."""
    executor = make_executor(tiny_models["llama"], granularity="operator", chunk_size=256)
    prompts = random_prompts([700, 300], executor.vocab_size, seed=5)
    solo = executor.prefill(prompts)
    rng = random.Random(0)
    control = TaskControl("storm")
    task = TaskThread(executor, prompts, control).start()
    num_parked = 0
    while not control.done:
        time.sleep(rng.uniform(0.0, 0.002))
        parked, _ = control.request_preempt(timeout_s=TIMEOUT_S)
        if parked:
            num_parked += 1
            assert control.parked
            time.sleep(rng.uniform(0.0, 0.001))
            control.resume()
            while control.parked:  # the task thread clears it once awake
                time.sleep(0)
    assert_bit_identical(task.join(), solo)
    assert num_parked >= 3  # the storm really interrupted the forward pass


def test_preempted_at_attention_boundary_has_not_run_o_proj(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor
) -> None:
    """Checkpoint 2 (operator) sits between attention and o_proj of layer 0."""
    model = tiny_models["llama"]
    executor = make_executor(model, granularity="operator")
    calls = []
    o_proj = model.get_submodule("model.layers.0.self_attn.o_proj")
    # prepend: the probe must run before the checkpoint hook that parks the task
    probe = o_proj.register_forward_hook(lambda *_: calls.append(1), prepend=True)
    try:
        control = StopAt("A", at=[2, 3])
        task = TaskThread(executor, random_prompts([9], executor.vocab_size, 6), control).start()
        control.preempt_at(2)
        assert calls == []  # attention done, o_proj not started
        control.resume()
        control.preempt_at(3)
        assert calls == [1]  # o_proj finished
        control.resume()
        task.join()
    finally:
        probe.remove()


def test_cancel_while_parked_raises_in_task(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor
) -> None:
    executor = make_executor(tiny_models["qwen2"], granularity="operator")
    control = StopAt("A", at=[4])
    task = TaskThread(executor, random_prompts([12], executor.vocab_size, 7), control).start()
    control.preempt_at(4)
    control.cancel()
    with pytest.raises(TaskCancelledError):
        task.join()


def test_resumed_task_is_unaffected_by_another_threads_checkpoints(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor
) -> None:
    """Checkpoints of task B count on B's control only (thread-local dispatch)."""
    executor = make_executor(tiny_models["qwen3-moe"], granularity="operator")
    control_a = StopAt("A", at=[1])
    a = TaskThread(executor, random_prompts([8], executor.vocab_size, 8), control_a).start()
    control_a.preempt_at(1)
    control_b = TaskControl("B")
    TaskThread(executor, random_prompts([8], executor.vocab_size, 9), control_b).start().join()
    assert control_a.num_checkpoints == 1
    assert control_b.num_checkpoints == executor.expected_checkpoints([8])
    control_a.resume()
    a.join()
    assert control_a.num_checkpoints == executor.expected_checkpoints([8])
