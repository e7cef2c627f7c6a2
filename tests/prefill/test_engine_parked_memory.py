"""The engine under a parked-memory budget: many long prompts, each more urgent than the
last, would park one another; the budget caps what the parked ones hold."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch

from flowprefill.contracts.metrics import (
    PREFILL_PARKED_BUDGET_BYTES,
    PREFILL_PARKED_BYTES,
    PREFILL_PREEMPTIONS_DECLINED,
)
from flowprefill.models import build_named
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor

NUM_PROMPTS = 6
PROMPT_TOKENS = 1500


@dataclass
class Run:
    first_tokens: list[int]
    max_parked_bytes: int
    max_parked_tasks: int
    max_gauge_bytes: float
    num_declined: float
    num_preemptions: int


@pytest.fixture(scope="module")
def executor() -> PreemptibleExecutor:
    torch.set_num_threads(1)
    return PreemptibleExecutor(build_named("tiny-llama", seed=1))


@pytest.fixture(scope="module")
def prompts(executor: PreemptibleExecutor) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [
        torch.randint(0, executor.vocab_size, (PROMPT_TOKENS + 7 * i,), generator=gen).tolist()
        for i in range(NUM_PROMPTS)
    ]


def run_workload(
    executor: PreemptibleExecutor, prompts: list[list[int]], budget: int | None
) -> Run:
    t0 = time.perf_counter()
    executor.prefill([prompts[0]])
    prefill_s = time.perf_counter() - t0
    predictor = TTFTPredictor.linear(per_token_s=prefill_s / PROMPT_TOKENS)
    engine = PrefillEngine(executor, predictor, batching="none", parked_memory_bytes=budget)
    registry = engine.metrics.registry
    stop = threading.Event()
    peaks: dict[str, int] = {"pool": 0, "tasks": 0}
    gauge_peak = [0.0]

    def sample() -> None:  # the scheduler thread changes both; sample them as it runs
        while not stop.is_set():
            peaks["pool"] = max(peaks["pool"], engine.pool.parked_bytes)
            peaks["tasks"] = max(peaks["tasks"], len(engine.scheduler.preempted))
            gauge = registry.get_sample_value(PREFILL_PARKED_BYTES) or 0.0
            gauge_peak[0] = max(gauge_peak[0], gauge)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    with engine:
        sampler.start()
        futures = []
        for i, prompt in enumerate(prompts):
            # Each arrival's deadline is earlier than the last's (all feasible): under
            # S-EDF each would preempt the one running when it arrives.
            futures.append(engine.submit(prompt, ttft_slo_s=1000.0 - 100.0 * i))
            time.sleep(prefill_s / 6)
        results = [f.result(timeout=300) for f in futures]
        stop.set()
        sampler.join()
    if budget is not None:
        assert registry.get_sample_value(PREFILL_PARKED_BUDGET_BYTES) == budget
    return Run(
        first_tokens=[r.output.first_token_id for r in results],
        max_parked_bytes=peaks["pool"],
        max_parked_tasks=peaks["tasks"],
        max_gauge_bytes=gauge_peak[0],
        num_declined=registry.get_sample_value(PREFILL_PREEMPTIONS_DECLINED + "_total") or 0.0,
        num_preemptions=sum(r.num_preemptions for r in results),
    )


def test_the_budget_caps_parked_bytes_and_changes_no_result(
    executor: PreemptibleExecutor, prompts: list[list[int]]
) -> None:
    alone = [executor.prefill([p])[0].first_token_id for p in prompts]
    # Room for one parked prompt at its bound: a second never fits beside it.
    budget = executor.estimate_parked_bytes(max(len(p) for p in prompts))

    bounded = run_workload(executor, prompts, budget)
    unbounded = run_workload(executor, prompts, None)

    assert bounded.first_tokens == alone and unbounded.first_tokens == alone
    assert 0 < bounded.max_parked_bytes <= budget
    assert 0 < bounded.max_gauge_bytes <= budget
    # It still preempts where the parked set fits, and declines where it would not.
    assert bounded.max_parked_tasks == 1
    assert bounded.num_preemptions >= 1 and bounded.num_declined >= 1
    # Without the budget the same arrivals park several prompts at once.
    assert unbounded.num_declined == 0
    assert unbounded.max_parked_tasks >= 2
    assert unbounded.max_parked_bytes > bounded.max_parked_bytes
