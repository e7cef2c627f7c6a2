"""The indexed round decides exactly what ranking every entry decided: the randomized
event sequences of the invariant tests (``test_core.py``), replayed through
:class:`~flowprefill.lab.ranking.RankingScheduler` and :class:`Scheduler`,
give the same commands, batches and declined preemptions in every round, under every
policy and batching, with and without a parked-memory budget."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from flowprefill.lab.ranking import RankingScheduler
from flowprefill.lab.sim.batching import SIM_BATCHING, get_batching
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.core import Scheduler, SchedulerOutput
from flowprefill.prefill.scheduler.memory import ParkedMemory
from flowprefill.prefill.scheduler.policies import get_policy
from tests.prefill.scheduler.test_core import arrival_op, cancel_op, complete_op

Op = tuple[object, ...]
Round = tuple[list[tuple[str, list[str]]], list[str] | None]

PREDICTORS: dict[str, Callable[[int], float]] = {
    "linear": TTFTPredictor(coefficients=[0.0, 0.0005]).predict_s,
    # A profile's polynomial, monotone: batching also skips what is too slow.
    "profile": TTFTPredictor(coefficients=[0.004, 2.5e-4, 1.5e-7]).predict_s,
    "quadratic": lambda n: 0.004 + n * 2.5e-5 + n * n * 1.5e-8,
    # Exact binary fractions, times on a 1/8 s grid and prompts of 128k tokens: slack
    # exactly zero happens.
    "exact": lambda n: n / 1024,
    # Not monotone in the token count (a badly fitted profile): nothing may assume it is.
    "wavy": lambda n: 0.1 + (n % 700) * 0.001,
}


def summary(out: SchedulerOutput) -> Round:
    commands = [(c.kind.value, [r.request_id for r in c.task.requests]) for c in out.commands]
    declined = out.declined_preemption
    return commands, None if declined is None else [r.request_id for r in declined.requests]


def replay(scheduler: Scheduler, ops: list[Op], grid: bool) -> list[Round]:
    """Feed ``ops`` (the invariant test's encoding) to ``scheduler``; every round's summary."""
    rounds: list[Round] = []
    now, added = 1.0, []
    for i, op in enumerate(ops):
        step = float(op[1])  # type: ignore[arg-type]
        now += round(step * 8) / 8 if grid else step
        if op[0] == "arrive":
            tokens = int(op[2])  # type: ignore[call-overload]
            r = Request.create(
                f"r{i}",
                arrival_s=now,
                ttft_slo_s=float(op[3]),  # type: ignore[arg-type]
                # On the grid, batches that fill the budget exactly happen too.
                num_tokens=max(128, round(tokens / 128) * 128) if grid else tokens,
            )
            added.append(r.request_id)
            scheduler.add(r)
        elif op[0] == "complete":
            if scheduler.running is None:
                continue
            for t in scheduler.preempted.values():
                t.progress = float(op[2])  # type: ignore[arg-type]
            scheduler.finish(scheduler.running, now)
        else:
            if not added:
                continue
            ids = sorted(added)
            empty = scheduler.cancel(ids[int(op[2]) % len(ids)], now)  # type: ignore[call-overload]
            if empty is not None:
                scheduler.finish(empty, now, failed=True)
        rounds.append(summary(scheduler.schedule(now)))
    return rounds


def build(cls: type[Scheduler], policy: str, batching: str, budget: int, parked: int | None,
          predictor: str) -> Scheduler:  # fmt: skip
    memory = ParkedMemory(parked, estimate=lambda tokens, n: tokens * 100 + n) if parked else None
    return cls(
        predict_s=PREDICTORS[predictor],
        policy=get_policy(policy),
        batching=get_batching(batching),
        token_budget=budget,
        parked_memory=memory,
    )


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.one_of(arrival_op, arrival_op, complete_op, cancel_op), max_size=80),
    policy=st.sampled_from(["s-edf", "d-edf", "edf", "fcfs"]),
    batching=st.sampled_from(sorted(SIM_BATCHING)),
    budget=st.sampled_from([1024, 4096]),
    parked=st.sampled_from([None, 150_000, 400_000]),
    predictor=st.sampled_from(sorted(PREDICTORS)),
)
def test_indexed_rounds_decide_what_ranking_decided(
    ops: list[Op], policy: str, batching: str, budget: int, parked: int | None, predictor: str
) -> None:
    grid = predictor == "exact"
    expected = replay(
        build(RankingScheduler, policy, batching, budget, parked, predictor), ops, grid
    )
    actual = replay(build(Scheduler, policy, batching, budget, parked, predictor), ops, grid)
    assert actual == expected


def test_a_zero_slack_request_ranks_between_feasible_and_late_ones() -> None:
    # Latest start exactly now: S-EDF's key of slack 0, after every feasible request and
    # before every late one (the queue finds it among its switches, not in a list).
    s = Scheduler(predict_s=PREDICTORS["exact"], batching=get_batching("none"))
    s.add(Request.create("zero", arrival_s=0.0, ttft_slo_s=0.5, num_tokens=256))  # 0.25 s
    s.add(Request.create("late", arrival_s=0.0, ttft_slo_s=0.25, num_tokens=512))
    s.add(Request.create("fine", arrival_s=0.0, ttft_slo_s=6.0, num_tokens=8))
    order = [s.schedule(0.25).commands[-1].task.leader.request_id]
    for _ in range(2):
        assert s.running is not None
        s.finish(s.running, 0.25)
        order.append(s.schedule(0.25).commands[-1].task.leader.request_id)
    assert order == ["fine", "zero", "late"]


def test_a_request_that_fills_the_budget_exactly_is_not_skipped() -> None:
    # The queue skips what cannot fit the room left; the budget is inclusive.
    s = Scheduler(predict_s=PREDICTORS["linear"], token_budget=1000)
    s.add(Request.create("lead", arrival_s=0.0, ttft_slo_s=4.0, num_tokens=300))
    s.add(Request.create("big", arrival_s=0.0, ttft_slo_s=6.0, num_tokens=701))
    s.add(Request.create("exact", arrival_s=0.0, ttft_slo_s=6.0, num_tokens=700))
    out = s.schedule(0.0)
    assert [r.request_id for r in out.commands[0].task.requests] == ["lead", "exact"]


def test_a_monotone_profile_lets_batching_skip_what_is_too_slow() -> None:
    assert Scheduler(predict_s=PREDICTORS["profile"]).predict_monotone
    assert not Scheduler(predict_s=PREDICTORS["wavy"]).predict_monotone
    falling = TTFTPredictor(coefficients=[0.1, -1e-5, 1e-9])
    assert not falling.monotone and not Scheduler(predict_s=falling.predict_s).predict_monotone
    # Forced on for a predictor that is not: candidates wrongly skipped change the batch
    # (what the replay would catch were the flag ever set wrongly).
    wavy = PREDICTORS["wavy"]  # 0.1 + (n % 700) ms: 699 tokens slow, 700 fast again
    batches = []
    for monotone in (False, True):
        # A full budget is too slow here (2,090 tokens: 0.79 s), so candidates are checked.
        s = Scheduler(predict_s=wavy, token_budget=2090, predict_monotone=monotone)
        s.add(Request.create("lead", arrival_s=0.0, ttft_slo_s=0.75, num_tokens=1))
        s.add(Request.create("slow", arrival_s=0.0, ttft_slo_s=6.0, num_tokens=698))
        s.add(Request.create("fast", arrival_s=0.0, ttft_slo_s=6.5, num_tokens=699))
        batches.append([r.request_id for r in s.schedule(0.0).commands[0].task.requests])
    assert batches == [["lead", "fast"], ["lead"]]


def test_a_monotone_profile_whose_full_budget_fits_predicts_no_candidate() -> None:
    # Slo-aware batching with a monotone predictor asks for the full budget's time once:
    # when that fits the leader, every batch within the budget does.
    calls: list[int] = []
    linear = TTFTPredictor(coefficients=[0.0, 0.001])

    def counted(n: int) -> float:
        calls.append(n)
        return linear.predict_s(n)

    s = Scheduler(predict_s=counted, token_budget=1000, predict_monotone=True)
    for i, tokens in enumerate((100, 300, 500, 200)):
        s.add(Request.create(f"r{i}", arrival_s=0.0, ttft_slo_s=2.0 + i, num_tokens=tokens))
    calls.clear()
    out = s.schedule(0.0)
    assert [r.request_id for r in out.commands[0].task.requests] == ["r0", "r1", "r2"]
    # The budget was predicted, the grown batch of 400 tokens never (900: the task's time).
    assert 1000 in calls and 400 not in calls
    # Forced on for a predictor that is not monotone, it admits what is too slow (what
    # the replay would catch were the flag ever set wrongly): 699 tokens take 0.799 s.
    batches = []
    for monotone in (False, True):
        s = Scheduler(predict_s=PREDICTORS["wavy"], token_budget=2000, predict_monotone=monotone)
        s.add(Request.create("lead", arrival_s=0.0, ttft_slo_s=0.75, num_tokens=1))
        s.add(Request.create("slow", arrival_s=0.0, ttft_slo_s=6.0, num_tokens=698))
        batches.append([r.request_id for r in s.schedule(0.0).commands[0].task.requests])
    assert batches == [["lead"], ["lead", "slow"]]


def test_only_larger_candidates_are_skipped_after_one_too_slow() -> None:
    s = Scheduler(predict_s=TTFTPredictor(coefficients=[0.0, 0.001]).predict_s)
    s.add(Request.create("lead", arrival_s=0.0, ttft_slo_s=0.6, num_tokens=1))
    s.add(Request.create("too-slow", arrival_s=0.0, ttft_slo_s=6.0, num_tokens=600))
    s.add(Request.create("larger", arrival_s=0.0, ttft_slo_s=6.1, num_tokens=601))
    s.add(Request.create("smaller", arrival_s=0.0, ttft_slo_s=6.2, num_tokens=598))
    batch = s.schedule(0.0).commands[0].task.requests
    assert [r.request_id for r in batch] == ["lead", "smaller"]


def test_the_waiting_tokens_are_kept_as_requests_come_and_go() -> None:
    s = Scheduler(predict_s=PREDICTORS["linear"], batching=get_batching("none"))
    for i, tokens in enumerate((5, 7, 11)):
        s.add(Request.create(f"r{i}", arrival_s=0.0, ttft_slo_s=1.0 + i, num_tokens=tokens))
    assert s.waiting_tokens == 23
    s.schedule(0.0)  # r0 runs
    s.cancel("r2", 0.0)
    assert s.waiting_tokens == 7 == sum(r.num_tokens for r in s.waiting.values())
