"""Policy names: one parser (contracts.names) behind every registry that takes a name."""

from __future__ import annotations

import pytest

from flowprefill.contracts import EngineConfig
from flowprefill.contracts.names import Admission, Batching, Policy, Router
from flowprefill.errors import UnknownNameError
from flowprefill.lab.sim.gateway import ADMISSIONS, ROUTERS, get_admission, get_router
from flowprefill.prefill.scheduler.batching import BATCHING, get_batching
from flowprefill.prefill.scheduler.policies import POLICIES, SlackEDF, get_policy


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
