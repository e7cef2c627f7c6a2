"""The scheduling round (Algorithm 2) on hand-built and randomized event sequences.

The scheduler also runs the simulator's systems, so its invariants are checked under every
batching either offers (the simulator's registry holds the engine's too)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowprefill.errors import InvalidRequestError, UnknownNameError, UnknownTaskError
from flowprefill.lab.sim.batching import SIM_BATCHING, get_batching
from flowprefill.prefill.request import Request, RequestState, Task
from flowprefill.prefill.scheduler.core import CommandKind, Scheduler, SchedulerOutput
from flowprefill.prefill.scheduler.policies import SlackEDF, get_policy


def per_token(ms: float = 1.0) -> Callable[[int], float]:
    return lambda n: n * ms / 1000.0


def req(rid: str, tokens: int, arrival: float, slo: float) -> Request:
    return Request.create(rid, arrival_s=arrival, ttft_slo_s=slo, num_tokens=tokens)


def kinds(out: SchedulerOutput) -> list[tuple[str, list[str]]]:
    return [(c.kind.value, [r.request_id for r in c.task.requests]) for c in out.commands]


def test_figure8_submit_preempt_submit_resume() -> None:
    """Paper Figure 8: A (relaxed) runs, B (urgent) arrives and preempts it, A resumes."""
    s = Scheduler(predict_s=per_token(1.0), batching=get_batching("none"))
    s.add(req("A", 1000, arrival=1.0, slo=10.0))
    out = s.schedule(1.0)
    assert kinds(out) == [("submit", ["A"])]
    task_a = s.running

    s.add(req("B", 100, arrival=1.2, slo=0.5))
    out = s.schedule(1.2)
    assert kinds(out) == [("preempt", ["A"]), ("submit", ["B"])]
    assert task_a is not None and task_a.leader.state is RequestState.PREEMPTED
    task_b = s.running

    assert task_b is not None
    s.finish(task_b, 1.35)
    out = s.schedule(1.35)
    assert kinds(out) == [("resume", ["A"])]
    assert out.commands[0].task is task_a

    s.finish(task_a, 2.2)
    out = s.schedule(2.2)
    assert out.commands == []
    assert (s.stats.num_rounds, s.stats.num_command_rounds) == (4, 3)
    assert task_a.leader.num_preemptions == 1
    assert task_b.leader.met_slo and task_a.leader.met_slo


def test_fcfs_keeps_head_of_line_blocking() -> None:
    s = Scheduler(predict_s=per_token(), policy=get_policy("fcfs"), batching=get_batching("none"))
    s.add(req("long", 4000, 0.0, 10.0))
    s.schedule(0.0)
    s.add(req("urgent", 10, 0.1, 0.05))
    assert s.schedule(0.1).commands == []


def test_slo_aware_batching_respects_budget_and_leader_deadline() -> None:
    s = Scheduler(predict_s=per_token(1.0), token_budget=1000)
    s.add(req("h", 300, 0.0, 0.9))  # leader: 0.9 s left
    s.add(req("a", 300, 0.0, 5.0))  # 600 tok -> 0.6 s fits
    s.add(req("b", 500, 0.0, 6.0))  # 1100 > budget: skipped
    s.add(req("c", 200, 0.0, 7.0))  # 800 tok -> 0.8 s fits
    s.add(req("d", 150, 0.0, 8.0))  # 950 tok -> 0.95 s > 0.9 s remaining: skipped
    out = s.schedule(0.0)
    assert kinds(out) == [("submit", ["h", "a", "c"])]
    assert set(s.waiting) == {"b", "d"}


def test_negative_slack_request_yields_to_feasible_ones() -> None:
    s = Scheduler(predict_s=per_token(1.0), batching=get_batching("none"))
    s.add(req("hopeless", 2000, 0.0, 1.0))  # needs 2 s, has 1 s
    s.add(req("feasible", 500, 0.0, 3.0))
    out = s.schedule(0.0)
    assert kinds(out) == [("submit", ["feasible"])]
    # EDF would have picked the earlier deadline regardless of feasibility.
    e = Scheduler(predict_s=per_token(1.0), policy=get_policy("edf"), batching=get_batching("none"))
    e.add(req("hopeless", 2000, 0.0, 1.0))
    e.add(req("feasible", 500, 0.0, 3.0))
    assert kinds(e.schedule(0.0)) == [("submit", ["hopeless"])]


def test_dedf_only_sinks_missed_deadlines() -> None:
    s = Scheduler(
        predict_s=per_token(1.0), policy=get_policy("d-edf"), batching=get_batching("none")
    )
    s.add(req("late", 10, 0.0, 0.5))
    s.add(req("ok", 10, 0.0, 3.0))
    assert kinds(s.schedule(1.0)) == [("submit", ["ok"])]


def test_priority_matches_paper_formula() -> None:
    from flowprefill.prefill.scheduler.policies import RankInput

    pol = SlackEDF()
    feasible = RankInput(deadline_s=10.0, arrival_s=0.0, predicted_remaining_s=1.0, seq=0)
    late = RankInput(deadline_s=10.0, arrival_s=0.0, predicted_remaining_s=20.0, seq=1)
    assert pol.priority(feasible, 0.0) == pytest.approx(0.1)
    assert pol.priority(late, 0.0) == pytest.approx(-0.1)


def test_bad_input_is_named() -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        Request.create("x", arrival_s=0.0, ttft_slo_s=1.0, prompt_token_ids=[])
    with pytest.raises(InvalidRequestError, match="positive"):
        Request.create("x", arrival_s=0.0, ttft_slo_s=0.0, num_tokens=5)
    with pytest.raises(InvalidRequestError, match="positive"):
        Request.create("x", arrival_s=0.0, ttft_slo_s=-2, num_tokens=5)
    with pytest.raises(InvalidRequestError, match="context"):
        Request.create("x", arrival_s=0.0, ttft_slo_s=1, num_tokens=5000, max_tokens=4096)
    with pytest.raises(UnknownNameError, match="s-edf"):
        get_policy("lifo")
    with pytest.raises(UnknownNameError, match="slo-aware"):
        get_batching("fifo")
    s = Scheduler(predict_s=per_token())
    with pytest.raises(UnknownTaskError, match="neither running nor preempted"):
        s.finish(Task([req("ghost", 5, 0.0, 1.0)]), 0.0)
    s.add(req("dup", 5, 0.0, 1.0))
    with pytest.raises(InvalidRequestError, match="already queued"):
        s.add(req("dup", 5, 0.0, 1.0))


# --------------------------------------------------------------------- randomized

arrival_op = st.tuples(
    st.just("arrive"),
    st.floats(0.0, 0.5),  # time advance
    st.integers(1, 3000),  # tokens
    st.sampled_from([0.25, 0.5, 4.0, 6.0]),  # the paper's Llama3-8B SLOs
)
complete_op = st.tuples(st.just("complete"), st.floats(0.0, 0.5), st.floats(0.0, 1.0))
cancel_op = st.tuples(st.just("cancel"), st.floats(0.0, 0.1), st.integers(0, 50))


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(st.one_of(arrival_op, arrival_op, complete_op, cancel_op), max_size=60),
    policy=st.sampled_from(["s-edf", "d-edf", "edf", "fcfs"]),
    batching=st.sampled_from(sorted(SIM_BATCHING)),
    budget=st.sampled_from([1024, 4096]),
)
def test_invariants_hold_after_every_event(
    ops: list[tuple], policy: str, batching: str, budget: int
) -> None:
    s = Scheduler(
        predict_s=per_token(0.5),
        policy=get_policy(policy),
        batching=get_batching(batching),
        token_budget=budget,
    )
    now = 1.0
    added: dict[str, Request] = {}
    submitted: list[str] = []
    for i, op in enumerate(ops):
        now += op[1]
        if op[0] == "arrive":
            r = req(f"r{i}", op[2], now, op[3])
            added[r.request_id] = r
            s.add(r)
        elif op[0] == "complete":
            if s.running is None:
                continue
            # Partial progress of the finishing task's peers is irrelevant; mark some
            # preempted tasks as half done to exercise remaining-time prediction.
            for t in s.preempted.values():
                t.progress = op[2]
            s.finish(s.running, now)
        else:
            ids = sorted(added)
            if not ids:
                continue
            empty = s.cancel(ids[op[2] % len(ids)], now)
            if empty is not None:
                s.finish(empty, now, failed=True)
        out = s.schedule(now)
        for c in out.commands:
            if c.kind is CommandKind.SUBMIT:
                submitted.extend(r.request_id for r in c.task.requests)

        items = s.runnable()
        if items:
            # The running task is the highest-priority runnable entry.
            assert s.running is not None
            best = min(s.sort_key(x, now) for x in items)
            assert s.sort_key(s.running, now) == best
            if policy == "s-edf":
                pol = SlackEDF()
                run_slack = pol.slack_s(s.rank_input(s.running), now)
                if run_slack < 0:
                    # Negative slack never runs ahead of a feasible entry.
                    assert all(pol.slack_s(s.rank_input(x), now) <= 0 for x in items)
        # No request is lost or duplicated across the queues.
        in_tasks = [r.request_id for t in s._tasks() for r in t.requests]
        places = list(s.waiting) + in_tasks
        assert len(places) == len(set(places))
        finished = {rid for rid, r in added.items() if r.is_terminal}
        live = {rid for rid in places if not added[rid].is_terminal}
        assert live | finished == set(added)
        # Never submitted twice.
        assert len(submitted) == len(set(submitted))
        assert s.stats.num_command_rounds <= s.stats.num_rounds


def test_preempt_that_races_with_completion_finishes_cleanly() -> None:
    """The pool may report that a task it was asked to preempt had already finished."""
    s = Scheduler(predict_s=per_token(1.0), batching=get_batching("none"))
    s.add(req("A", 1000, arrival=1.0, slo=10.0))
    s.schedule(1.0)
    task_a = s.running
    s.add(req("B", 10, arrival=1.5, slo=0.1))
    assert kinds(s.schedule(1.5))[0] == ("preempt", ["A"])
    assert task_a is not None and task_a.task_id in s.preempted
    s.finish(task_a, 1.51)  # its completion event: it finished before the checkpoint
    assert task_a.leader.state is RequestState.FINISHED
    assert task_a.task_id not in s.preempted
    assert s.schedule(1.52).commands == []  # B keeps running; nothing to resume


def test_a_batch_never_ranks_below_an_entry_it_leaves_outside() -> None:
    """Found by the randomized invariants: greedy batching put an infeasible 500-token
    request into a feasible 1-token leader's batch, which then ranked below the task it
    had just preempted (and would have been preempted by it at the next round). The
    member that sinks the batch stays in the queue instead."""
    s = Scheduler(
        predict_s=per_token(0.5),
        policy=get_policy("s-edf"),
        batching=get_batching("greedy"),
        token_budget=1024,
    )
    now = 1.0
    s.add(req("long", 318, now, 0.5))
    s.schedule(now)
    s.add(req("doomed", 500, now, 0.25))
    s.schedule(now)
    s.add(req("urgent", 1, now, 0.25))
    out = s.schedule(now)
    assert [c.kind for c in out.commands] == [CommandKind.PREEMPT, CommandKind.SUBMIT]
    assert s.running is not None
    assert [r.request_id for r in s.running.requests] == ["urgent"]
    assert "doomed" in s.waiting
    assert s.sort_key(s.running, now) == min(s.sort_key(x, now) for x in s.runnable())


def test_a_held_task_is_predicted_once_and_keyed_by_its_progress() -> None:
    """A task's requests never change, so its whole predicted time is kept while the
    scheduler holds it; its remaining time still follows its progress."""
    calls: list[int] = []

    def counted(n: int) -> float:
        calls.append(n)
        return n / 1000.0

    s = Scheduler(predict_s=counted, batching=get_batching("none"))
    s.add(req("A", 1000, arrival=0.0, slo=10.0))
    s.schedule(0.0)
    task = s.running
    assert task is not None
    for progress in (0.0, 0.5, 0.75):
        task.progress = progress
        assert s.rank_input(task).predicted_remaining_s == 1.0 * (1.0 - progress)
        s.schedule(0.1)  # a no-op round keys the running task
    assert calls.count(1000) == 2  # on arrival, and the task once
    s.finish(task, 0.2)
    assert s.rank_input(task).predicted_remaining_s == 0.25  # no longer kept: predicted
    assert calls.count(1000) == 3
