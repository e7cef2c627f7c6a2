"""The waiting queue reads in the order a full sort by the policy's key gives, at every
instant, whatever came, left and moved before; its lazily deleted items stay bounded."""

from __future__ import annotations

import heapq
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.policies import RankInput, get_policy
from flowprefill.prefill.scheduler.waiting import COMPACT_SLACK, Candidates, WaitingQueue


def predicted_s(num_tokens: int) -> float:
    return num_tokens / 1024  # exact binary fractions: keys hit "exactly now" on the grid


def rank(request: Request) -> RankInput:
    return RankInput(
        request.deadline_s, request.arrival_s, predicted_s(request.num_tokens), request.seq
    )


def expected(queue: WaitingQueue, live: dict[str, Request], now_s: float) -> list[str]:
    """The order ranking every waiting request gives."""
    policy = queue.policy
    return [
        r.request_id for r in sorted(live.values(), key=lambda r: policy.sort_key(rank(r), now_s))
    ]


def ops() -> st.SearchStrategy[list[tuple[str, int, int]]]:
    return st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "remove", "tick"]),
            st.integers(0, 40),  # which request id (ids come back after they leave)
            st.integers(1, 5000),  # tokens, or ticks of 1/8 s
        ),
        max_size=120,
    )


@settings(max_examples=200, deadline=None)
@given(ops(), st.sampled_from(["s-edf", "d-edf", "edf", "fcfs"]), st.integers(1, 6000))
def test_order_matches_a_full_sort_at_every_instant(
    script: list[tuple[str, int, int]], policy: str, room: int
) -> None:
    queue = WaitingQueue(get_policy(policy))
    live: dict[str, Request] = {}
    now = 1.0
    for op, which, amount in script:
        rid = f"r{which}"
        if op == "add" and rid not in live:
            r = Request.create(rid, arrival_s=now, ttft_slo_s=amount / 512, num_tokens=amount)
            live[rid] = r
            queue.add(r, rank(r))
        elif op == "remove":
            removed = queue.remove(rid)
            assert removed is live.pop(rid, None)
        elif op == "tick":
            now += (amount % 16) / 8  # often lands exactly on a latest start (slack 0)
        order = expected(queue, live, now)
        assert [r.request_id for _, r in queue.ordered(now)] == order
        first = queue.first(now)
        assert (first[1].request_id if first else None) == (order[0] if order else None)
        assert len(queue) == len(live)
        assert queue.num_tokens == sum(r.num_tokens for r in live.values())
    # With a room promised, the requests that fit, still in order.
    candidates = Candidates(queue, now, skip=None)
    candidates.max_tokens = room
    fitting = [rid for rid in expected(queue, live, now) if live[rid].num_tokens <= room]
    assert [r.request_id for r in candidates] == fitting


def test_a_shrinking_room_drops_what_no_longer_fits_as_it_goes() -> None:
    queue = WaitingQueue(get_policy("edf"))
    for i, tokens in enumerate([900, 100, 600, 50, 700, 20]):
        r = Request.create(f"r{i}", arrival_s=0.0, ttft_slo_s=1.0 + i, num_tokens=tokens)
        queue.add(r, rank(r))
    candidates = Candidates(queue, 0.0, skip="r0")
    candidates.max_tokens = 1000
    seen = []
    for r in candidates:
        seen.append(r.request_id)
        candidates.max_tokens = 60  # a batch took it: only small requests fit now
    assert seen == ["r1", "r3", "r5"]


@pytest.mark.parametrize("policy", ["s-edf", "fcfs"])
def test_dead_items_stay_bounded_under_churn(policy: str) -> None:
    """Requests come and go far more often than the queue is read: the heaps' dead
    items are compacted, so what the queue holds stays proportional to what waits."""
    queue = WaitingQueue(get_policy(policy))
    now = 0.0
    for i in range(20_000):
        r = Request.create(f"r{i}", arrival_s=now, ttft_slo_s=50.0, num_tokens=1 + i % 3000)
        queue.add(r, rank(r))
        if i >= 100:  # a hundred wait; the oldest-but-five leaves (not the head)
            queue.remove(f"r{i - 95}")
        if i % 1000 == 0:
            now += 1.0
            queue.first(now)
        assert queue.held_items <= 3 * len(queue) + COMPACT_SLACK + 2
    assert len(queue) == 100
    assert [r.request_id for _, r in queue.ordered(now)] == expected(
        queue, {r.request_id: r for r in queue.requests()}, now
    )


def test_time_going_back_rebuilds_the_order() -> None:
    queue = WaitingQueue(get_policy("s-edf"))
    a = Request.create("a", arrival_s=0.0, ttft_slo_s=1.0, num_tokens=512)  # starts by 0.5
    b = Request.create("b", arrival_s=0.0, ttft_slo_s=2.0, num_tokens=64)
    for r in (a, b):
        queue.add(r, rank(r))
    assert [r.request_id for _, r in queue.ordered(0.0)] == ["a", "b"]
    assert [r.request_id for _, r in queue.ordered(0.75)] == ["b", "a"]  # a is late
    assert [r.request_id for _, r in queue.ordered(0.25)] == ["a", "b"]
    assert math.isclose(queue.num_tokens, 576)


def test_a_request_id_that_comes_back_is_read_once_at_its_new_place() -> None:
    """A request that left leaves dead items deep in its heap; the same id queued again
    (a retry) must be read once, under its new key, never under the dead item's."""
    queue = WaitingQueue(get_policy("edf"))
    first_b = None
    for rid, slo in [("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0)]:
        r = Request.create(rid, arrival_s=0.0, ttft_slo_s=slo, num_tokens=100)
        queue.add(r, rank(r))
        first_b = r if rid == "b" else first_b
    assert first_b is not None and queue.remove("b") is first_b  # not the top: stays, dead
    again = Request.create("b", arrival_s=0.0, ttft_slo_s=3.5, num_tokens=100)
    queue.add(again, rank(again))
    assert [r.request_id for _, r in queue.ordered(0.0)] == ["a", "c", "b", "d"]
    assert next(iter(Candidates(queue, 0.0, skip="a"))).request_id == "c"


def test_a_removed_requests_switch_item_goes_when_its_instant_passes() -> None:
    """A submit round does not pop a removed request's item from the switch heap; the
    item goes when its instant passes (or at a compaction), and the order stays right."""
    queue = WaitingQueue(get_policy("s-edf"))
    live: dict[str, Request] = {}
    for i in range(8):  # latest starts 0.5 + i/8 - i*64/1024 = 0.5 + i/16
        r = Request.create(f"r{i}", arrival_s=0.0, ttft_slo_s=0.5 + i / 8, num_tokens=64 * i + 1)
        live[r.request_id] = r
        queue.add(r, rank(r))
    held = queue.held_items  # each request in its bucket and in the switch heap
    assert held == 16
    for rid in ("r0", "r1", "r2"):  # the three earliest latest starts
        assert queue.remove(rid) is live.pop(rid)
    assert queue.held_items == held - 3  # bucket items popped (tops), switch items kept
    assert [r.request_id for _, r in queue.ordered(0.0)] == expected(queue, live, 0.0)
    now = 0.5 + 2.5 / 16  # past r0-r2's instants, before r3's
    assert [r.request_id for _, r in queue.ordered(now)] == expected(queue, live, now)
    assert queue.held_items == held - 6
    now = 2.0  # everyone late: the rest moved, their early items are dead
    assert [r.request_id for _, r in queue.ordered(now)] == expected(queue, live, now)
    assert len(queue) == 5


def test_the_walk_ends_once_nothing_can_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that filled its budget leaves a room smaller than any waiting request: the
    walk stops there, without popping what is left of its frontier one by one."""
    queue = WaitingQueue(get_policy("edf"))
    for i in range(50):
        r = Request.create(f"r{i}", arrival_s=0.0, ttft_slo_s=1.0 + i, num_tokens=64 << i % 5)
        queue.add(r, rank(r))
    pops: list[object] = []
    real_pop = heapq.heappop

    def counted_pop(heap: list[Any]) -> Any:
        pops.append(heap[0])
        return real_pop(heap)

    monkeypatch.setattr(heapq, "heappop", counted_pop)
    candidates = Candidates(queue, 0.0, skip=None)
    candidates.max_tokens = 10_000
    walk = iter(candidates)
    assert next(walk).request_id == "r0"
    walked = len(pops)
    candidates.max_tokens = 63  # below the smallest request (64 tokens)
    assert next(walk, None) is None
    assert len(pops) == walked  # nothing more was popped
