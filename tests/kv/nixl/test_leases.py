"""Leases: published prompts hold blocks until read, dropped or expired (fake clock)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from flowprefill.contracts.nixl import DEFAULT_LEASE_S, LEASE_EXTENSION_FRACTION
from flowprefill.kv.nixl.leases import Leases

LEASE_S = 30.0


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Released:
    """Records every release call, in order."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, block_ids: Sequence[int]) -> None:
        self.calls.append(list(block_ids))

    @property
    def blocks(self) -> list[int]:
        return sorted(b for call in self.calls for b in call)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def released() -> Released:
    return Released()


@pytest.fixture
def leases(clock: Clock, released: Released) -> Leases:
    return Leases(released, lease_s=LEASE_S, clock=clock)


def test_defaults_are_vllms() -> None:
    assert DEFAULT_LEASE_S == 30.0
    assert abs(LEASE_EXTENSION_FRACTION - 2 / 3) < 1e-12
    with pytest.raises(ValueError):
        Leases(lambda ids: None, lease_s=0)


def test_read_done_frees_after_all_consumers(leases: Leases, released: Released) -> None:
    leases.start("a", [1, 2])
    leases.start("b", [3])
    assert "a" in leases and len(leases) == 2
    assert leases.read_done("a", 3) is False
    assert leases.read_done("a", 3) is False
    assert released.calls == [] and "a" in leases
    assert leases.read_done("a", 3) is True
    assert released.calls == [[1, 2]]
    assert "a" not in leases and "b" in leases
    assert leases.completed_total == 1 and leases.expired_total == 0
    # a late reader of an ended lease changes nothing
    assert leases.read_done("a", 3) is False
    assert released.calls == [[1, 2]]


@pytest.mark.parametrize("consumers", [1, 0, -2])
def test_read_done_single_consumer(leases: Leases, released: Released, consumers: int) -> None:
    leases.start("a", [7])
    assert leases.read_done("a", consumers) is True
    assert released.calls == [[7]]


def test_unknown_id_is_false(leases: Leases, released: Released) -> None:
    assert leases.read_done("nobody", 1) is False
    assert leases.drop("nobody") is False
    leases.heartbeat(["nobody"])
    assert released.calls == [] and len(leases) == 0


def test_expiry_at_the_lease_deadline(leases: Leases, clock: Clock, released: Released) -> None:
    leases.start("a", [1])
    clock.now += LEASE_S - 0.001
    assert leases.expire() == [] and "a" in leases
    clock.now += 0.001
    assert leases.expire() == ["a"]
    assert released.calls == [[1]] and leases.expired_total == 1


def test_heartbeat_extends_to_two_thirds_of_a_lease(
    leases: Leases, clock: Clock, released: Released
) -> None:
    start = clock.now
    leases.start("a", [1])
    clock.now = start + 25.0
    leases.heartbeat(["a"])  # deadline: 25 + 20 = 45 > 30
    clock.now = start + 44.9
    assert leases.expire() == []
    clock.now = start + 45.0
    assert leases.expire() == ["a"]
    assert released.calls == [[1]]


def test_heartbeat_never_shortens(leases: Leases, clock: Clock) -> None:
    start = clock.now
    leases.start("a", [1])
    clock.now = start + 1.0
    leases.heartbeat(["a"])  # 1 + 20 = 21 < 30: keeps 30
    clock.now = start + 29.9
    assert leases.expire() == []
    clock.now = start + 30.0
    assert leases.expire() == ["a"]


def test_heartbeat_for_several_ids_and_unknown_ones(leases: Leases, clock: Clock) -> None:
    start = clock.now
    leases.start("a", [1])
    leases.start("b", [2])
    leases.start("c", [3])
    clock.now = start + 20.0
    leases.heartbeat(["a", "ghost", "c"])  # to 40
    clock.now = start + 35.0
    assert leases.expire() == ["b"]
    clock.now = start + 40.0
    assert sorted(leases.expire()) == ["a", "c"]


def test_expire_frees_exactly_the_expired(leases: Leases, clock: Clock, released: Released) -> None:
    leases.start("old", [0, 1])
    clock.now += 10
    leases.start("mid", [2])
    clock.now += 10
    leases.start("new", [3])
    clock.now += 15  # old: 35 >= 30; mid: 25; new: 15
    assert leases.expire() == ["old"]
    assert released.blocks == [0, 1]
    clock.now += 5  # mid: 30
    assert leases.expire() == ["mid"]
    assert released.blocks == [0, 1, 2]
    assert "new" in leases and len(leases) == 1
    assert leases.expired_total == 2 and leases.completed_total == 0
    assert leases.expire() == []


def test_drop_frees(leases: Leases, released: Released) -> None:
    leases.start("a", [4, 5])
    assert leases.drop("a") is True
    assert released.calls == [[4, 5]] and "a" not in leases
    assert leases.drop("a") is False
    assert leases.read_done("a", 1) is False
    assert released.calls == [[4, 5]]
    assert leases.completed_total == 0 and leases.expired_total == 0


def test_second_start_frees_the_first_blocks(
    leases: Leases, clock: Clock, released: Released
) -> None:
    start = clock.now
    leases.start("a", [1, 2])
    clock.now = start + 20
    leases.start("a", [3])  # a retried request
    assert released.calls == [[1, 2]] and len(leases) == 1
    clock.now = start + 45  # the new lease runs from its own start
    assert leases.expire() == []
    assert leases.read_done("a", 1) is True
    assert released.calls == [[1, 2], [3]]


def test_read_counts_restart_with_a_new_lease(leases: Leases, released: Released) -> None:
    leases.start("a", [1])
    assert leases.read_done("a", 2) is False
    leases.start("a", [2])
    assert leases.read_done("a", 2) is False  # the first lease's read does not count
    assert leases.read_done("a", 2) is True
    assert released.calls == [[1], [2]]
