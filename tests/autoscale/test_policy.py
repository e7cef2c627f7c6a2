"""The autoscaler's decision rules, on recorded and generated metric series."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flowprefill.autoscale.policy import (
    ClassSignal,
    Decision,
    PoolObservation,
    ScalerMemory,
    ScalerSettings,
    TpotSignal,
    WindowCounts,
    decide_decode,
    decide_prefill,
    fit_budget,
)

S = ScalerSettings(min_replicas=1, max_replicas=8)
NOW = 10_000.0
QUIET = ScalerMemory()


def obs(replicas: int = 2, warming: int = 0) -> PoolObservation:
    return PoolObservation(NOW, replicas, replicas - warming, warming)


def cls(
    name: str, short: tuple[int, int], long: tuple[int, int], target: float = 0.9
) -> ClassSignal:
    """(met, missed) per window."""
    return ClassSignal(name, target, WindowCounts(*short), WindowCounts(*long))


def test_burn_rate_is_the_missed_fraction_over_the_error_budget() -> None:
    c = cls("text", (80, 20), (90, 10))
    assert round(c.burn_rate(c.short), 6) == 2.0 and round(c.burn_rate(c.long), 6) == 1.0


def test_a_burst_in_the_short_window_alone_is_not_acted_on() -> None:
    burst = cls("text", short=(40, 60), long=(950, 50))  # 6x short, 0.5x long
    d = decide_prefill(S, obs(), QUIET, [burst])
    assert d.replicas == 2 and d.reason.startswith("hold") and d.driver == "text"


def test_sustained_burn_in_both_windows_scales_up_in_proportion() -> None:
    mild = cls("text", short=(75, 25), long=(78, 22))  # 2.5x / 2.2x: pressure 1.1
    d = decide_prefill(S, obs(2), QUIET, [mild])
    assert (d.replicas, d.driver) == (3, "text") and d.reason.startswith("scale up 2→3")
    severe = cls("text", short=(40, 60), long=(40, 60))  # 6x both: pressure 3 -> +4 (cap)
    assert decide_prefill(S, obs(2), QUIET, [severe]).replicas == 2 + S.max_step_up


def test_the_class_closest_to_missing_its_target_drives() -> None:
    """``batch`` misses more in absolute terms, but its budget is larger."""
    chat = cls("chat", (960, 40), (960, 40), target=0.99)  # 4% of a 1% budget: 4x
    batch = cls("batch", (700, 300), (700, 300), target=0.5)  # 30% of a 50% budget: 0.6x
    d = decide_prefill(S, obs(2), QUIET, [batch, chat])
    assert d.driver == "chat" and d.replicas > 2


def test_cool_down_and_warm_up_hold_a_second_step() -> None:
    hot = [cls("text", (50, 50), (50, 50))]
    recent = ScalerMemory(last_scale_up_s=NOW - 30)
    assert "cool-down" in decide_prefill(S, obs(3), recent, hot).reason
    assert decide_prefill(S, obs(3), recent, hot).replicas == 3
    assert "warming" in decide_prefill(S, obs(3, warming=1), QUIET, hot).reason
    later = ScalerMemory(last_scale_up_s=NOW - 61)
    assert decide_prefill(S, obs(3), later, hot).replicas > 3


def test_scale_down_needs_every_class_quiet_in_both_windows_and_enough_requests() -> None:
    quiet = cls("text", (1000, 2), (1000, 5))  # 0.02x / 0.05x
    warm = cls("image", (100, 4), (1000, 100))  # long window 1x: hysteresis band
    assert decide_prefill(S, obs(3), QUIET, [quiet]).replicas == 2
    assert decide_prefill(S, obs(3), QUIET, [quiet, warm]).replicas == 3
    sparse = cls("text", (5, 0), (9, 0))  # below min_requests: no evidence either way
    d = decide_prefill(S, obs(3), QUIET, [sparse])
    assert d.replicas == 3 and "too few requests" in d.reason
    after_up = ScalerMemory(last_scale_up_s=NOW - 300)  # any change holds a scale-down
    assert "cool-down" in decide_prefill(S, obs(3), after_up, [quiet]).reason


def test_a_rare_class_that_misses_holds_a_scale_down() -> None:
    """``file`` sees a few requests per window next to a busy ``text``: too few to scale
    up on, but its misses are evidence enough not to remove capacity."""
    busy = cls("text", (1000, 0), (9000, 10))
    rare = cls("file", (2, 2), (10, 8))
    d = decide_prefill(S, obs(3), QUIET, [busy, rare])
    assert d.replicas == 3
    rare_ok = cls("file", (4, 0), (18, 0))
    assert decide_prefill(S, obs(3), QUIET, [busy, rare_ok]).replicas == 2


def test_a_class_with_a_thin_short_window_still_scales_up() -> None:
    """Six requests in the short window (of twenty needed in the long one) are enough to
    confirm the long window's burn."""
    thin = cls("search", short=(1, 5), long=(30, 30))
    assert decide_prefill(S, obs(2), QUIET, [thin]).replicas > 2
    thinner = cls("search", short=(1, 3), long=(30, 30))  # 4 < min_short_requests
    assert decide_prefill(S, obs(2), QUIET, [thinner]).replicas == 2


def test_an_idle_pool_shrinks_to_its_minimum_one_step_at_a_time() -> None:
    idle = [cls("text", (0, 0), (0, 0))]
    memory, replicas, now = QUIET, 4, NOW
    seen = []
    for _ in range(10):
        d = decide_prefill(S, PoolObservation(now, replicas, replicas, 0), memory, idle)
        if d.replicas < replicas:
            memory = ScalerMemory(last_scale_down_s=now)
        replicas = d.replicas
        seen.append(replicas)
        now += S.scale_down_cooldown_s
    assert seen[:4] == [3, 2, 1, 1] and "minReplicas" in d.reason


def test_replicas_outside_the_bounds_are_brought_back_at_once() -> None:
    recent = ScalerMemory(last_scale_up_s=NOW, last_scale_down_s=NOW)
    assert decide_prefill(S, obs(0), recent, []).replicas == 1
    assert decide_prefill(S, obs(12), recent, []).replicas == 8


def test_decode_follows_p90_tpot_against_its_target() -> None:
    over = TpotSignal(slo_s=0.05, short_p90_s=0.08, long_p90_s=0.06)
    under = TpotSignal(slo_s=0.05, short_p90_s=0.02, long_p90_s=0.025)
    blip = TpotSignal(slo_s=0.05, short_p90_s=0.2, long_p90_s=0.04)
    assert decide_decode(S, obs(2), QUIET, over).replicas == 3
    assert decide_decode(S, obs(2), QUIET, under).replicas == 1
    assert decide_decode(S, obs(2), QUIET, blip).replicas == 2
    none = TpotSignal(slo_s=0.05, short_p90_s=None, long_p90_s=0.06)
    assert "no TPOT samples" in decide_decode(S, obs(2), QUIET, none).reason


def test_a_gpu_budget_cuts_scale_ups_most_urgent_first() -> None:
    decisions = {
        "prefill": Decision(6, "scale up 2→6: ...", "text", pressure=3.0),
        "decode": Decision(4, "scale up 2→4: ...", "tpot", pressure=1.2),
        "other": Decision(1, "scale down 2→1: ...", None),
    }
    gpus = {"prefill": 1, "decode": 2, "other": 1}
    current = {"prefill": 2, "decode": 2, "other": 2}
    fitted = fit_budget(decisions, gpus, 10, current)
    # other: 1 GPU; decode held at 2 x 2 = 4; 5 left: prefill gets +3 of its +4, decode 0.
    assert {p: d.replicas for p, d in fitted.items()} == {"prefill": 5, "decode": 2, "other": 1}
    assert "GPU budget" in fitted["prefill"].reason and "GPU budget" in fitted["decode"].reason
    assert fit_budget(decisions, gpus, None, current) == decisions
    assert fit_budget(decisions, gpus, 100, current) == decisions


windows = st.tuples(st.integers(0, 500), st.integers(0, 500)).map(lambda t: WindowCounts(*t))
signals = st.lists(
    st.builds(
        ClassSignal,
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from([0.5, 0.9, 0.99]),
        windows,
        windows,
    ),
    max_size=3,
)


@given(
    replicas=st.integers(1, 8),
    warming=st.integers(0, 2),
    classes=signals,
    since_up=st.none() | st.floats(0, 2000),
    since_down=st.none() | st.floats(0, 2000),
)
@settings(max_examples=300, deadline=None)
def test_invariants(
    replicas: int,
    warming: int,
    classes: list[ClassSignal],
    since_up: float | None,
    since_down: float | None,
) -> None:
    memory = ScalerMemory(
        None if since_up is None else NOW - since_up,
        None if since_down is None else NOW - since_down,
    )
    warming = min(warming, replicas)
    d = decide_prefill(S, obs(replicas, warming), memory, classes)
    assert S.min_replicas <= d.replicas <= S.max_replicas
    assert d.reason
    if d.replicas > replicas:
        assert warming == 0 and (since_up is None or since_up >= S.scale_up_cooldown_s)
        assert d.replicas - replicas <= S.max_step_up
    if d.replicas < replicas:
        assert d.replicas == replicas - 1 and warming == 0
        changes = [t for t in (since_up, since_down) if t is not None]
        assert all(t >= S.scale_down_cooldown_s for t in changes)
        for c in classes:  # never while any class, however rare, burns over the band
            for w in (c.short, c.long):
                assert c.burn_rate(w) <= S.scale_down_burn_rate


def test_a_measured_load_holds_a_scale_down_the_replicas_left_could_not_carry() -> None:
    """Attainment is perfect until a pool is nearly saturated: the load says how near."""
    quiet = [cls("text", (1000, 0), (9000, 0))]
    busy = PoolObservation(NOW, 3, 3, 0, load=1.6)  # 2 left would be 80 % busy
    d = decide_prefill(S, busy, QUIET, quiet)
    assert d.replicas == 3 and "80% busy" in d.reason
    light = PoolObservation(NOW, 3, 3, 0, load=1.2)  # 60 %
    assert decide_prefill(S, light, QUIET, quiet).replicas == 2
    assert decide_prefill(S, obs(3), QUIET, quiet).replicas == 2  # unmeasured: attainment
