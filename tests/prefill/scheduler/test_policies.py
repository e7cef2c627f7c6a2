"""Policy names: one parser (contracts.names) behind every registry that takes a name."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowprefill.contracts import EngineConfig
from flowprefill.contracts.names import Admission, Batching, Policy, Router
from flowprefill.errors import UnknownNameError
from flowprefill.lab.sim.gateway import ADMISSIONS, ROUTERS, get_admission, get_router
from flowprefill.prefill.scheduler.batching import BATCHING, get_batching
from flowprefill.prefill.scheduler.policies import POLICIES, RankInput, SlackEDF, get_policy


def test_every_registry_is_keyed_by_its_enum() -> None:
    assert set(POLICIES) == set(Policy)
    assert set(BATCHING) == set(Batching)
    assert set(ROUTERS) == set(Router)
    assert set(ADMISSIONS) == set(Admission)


@pytest.mark.parametrize("spelling", ["s-edf", "s_edf", "S_EDF", " S-EDF "])
def test_s_edf_is_accepted_in_every_spelling_wherever_s_edf_is(spelling: str) -> None:
    assert isinstance(get_policy(spelling), SlackEDF)
    assert EngineConfig(policy=spelling).policy is Policy.S_EDF


def test_every_name_builds_its_policy() -> None:
    for name in Policy:
        assert get_policy(name.value.upper().replace("-", "_")).name is name
    for batching in Batching:
        assert get_batching(batching.value.upper()).name is batching
    for admission in Admission:
        assert get_admission(admission.value.replace("-", "_")).name is admission


@pytest.mark.parametrize(
    ("build", "kind"),
    [
        (get_policy, "scheduling policy"),
        (get_batching, "batching policy"),
        (get_router, "routing policy"),
        (get_admission, "admission policy"),
    ],
)
def test_an_unknown_name_lists_the_valid_ones(build, kind: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnknownNameError, match=f"unknown {kind} 'lifo'") as e:
        build("lifo")
    assert e.value.known


@settings(max_examples=300, deadline=None)
@given(
    deadline=st.floats(0.001, 1e6),
    arrival=st.floats(0.0, 1e6),
    remaining=st.floats(0.0, 1e3),
    seq=st.integers(0, 10**6),
    offset=st.floats(-10.0, 10.0),
)
def test_each_policys_own_sort_key_is_its_phases_key(
    deadline: float, arrival: float, remaining: float, seq: int, offset: float
) -> None:
    # The policies compute the key a round needs directly; it must be the phases' key at
    # every instant: before the switch, exactly at it (slack zero) and after it.
    entry = RankInput(deadline, arrival, remaining, seq)
    for name in Policy:
        policy = get_policy(name)
        phases = policy.phases(entry)
        instants = [deadline + offset, arrival + offset, deadline - remaining]
        if phases.switch_s != math.inf:
            instants += [phases.switch_s, math.nextafter(phases.switch_s, -math.inf)]
            instants += [math.nextafter(phases.switch_s, math.inf)]
        for now in instants:
            assert policy.sort_key(entry, now) == phases.key(now), (name, now)
