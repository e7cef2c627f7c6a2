"""Sweep plumbing: the engine's Scheduler is what runs; results are reproducible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import flowprefill.prefill.scheduler.core as core
from flowprefill.bench.workload import qwen_like
from flowprefill.errors import InvalidRequestError, UnknownNameError
from flowprefill.lab.sim.config import SweepConfig, WorkloadSpec
from flowprefill.lab.sim.cost import build_cost_model
from flowprefill.lab.sim.report import write_json
from flowprefill.lab.sim.sweep import run_sweep
from flowprefill.lab.sim.systems import SYSTEMS, build_instance, fit_predictor, run_system
from flowprefill.prefill.scheduler.policies import SlackEDF

SMALL = SweepConfig(
    workload=WorkloadSpec(num_requests=150, seeds=(0, 1)),
    systems=("distserve-fcfs", "flowprefill"),
    rates=(2.0, 6.0, 12.0),
    slo_scales=(0.5, 1.0, 2.0),
    rel_tol=0.1,
    jobs=1,
)


def test_the_engines_scheduler_and_policies_are_the_ones_driven(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cost = build_cost_model("llama3-8b", "a100")
    inst = build_instance(SYSTEMS["flowprefill"], cost, fit_predictor(cost).predict_s)
    assert type(inst.scheduler) is core.Scheduler
    assert type(inst.scheduler.policy) is SlackEDF
    calls = {"schedule": 0, "phases": 0}
    real_schedule = core.Scheduler.schedule
    real_phases = SlackEDF.phases

    def schedule(self, now_s):  # type: ignore[no-untyped-def]
        calls["schedule"] += 1
        return real_schedule(self, now_s)

    def phases(self, entry):  # type: ignore[no-untyped-def]
        calls["phases"] += 1
        return real_phases(self, entry)

    monkeypatch.setattr(core.Scheduler, "schedule", schedule)
    monkeypatch.setattr(SlackEDF, "phases", phases)
    res = run_system(SYSTEMS["flowprefill"], qwen_like(100, seed=0), cost, rate=4.0)
    assert calls["schedule"] == res.num_rounds > 0
    assert calls["phases"] > 0


def test_a_seeded_sweep_is_reproducible_bit_for_bit(tmp_path: Path) -> None:
    first = run_sweep(SMALL, progress=False)
    second = run_sweep(SMALL.model_copy(update={"jobs": 2}), progress=False)
    write_json(first, tmp_path / "a.json")
    write_json(second, tmp_path / "b.json")
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    for d in (a, b):
        d.pop("wall_s")
        d["config"].pop("jobs")
    assert a == b
    fp, fcfs = first.by_name()["flowprefill"], first.by_name()["distserve-fcfs"]
    assert fp.goodput_rps > fcfs.goodput_rps > 0
    assert fp.oracle_goodput_rps is not None and first.bound_rps > 0
    assert fp.tightest_slo_scale <= fcfs.tightest_slo_scale
    assert fp.reference.blocking_mean_ms > 0 and fcfs.reference.num_preemptions == 0


@pytest.mark.parametrize(
    ("update", "error", "match"),
    [
        ({"systems": ("nope",)}, UnknownNameError, "system"),
        ({"target": 1.5}, InvalidRequestError, "--target"),
        ({"rates": (1.0, -2.0)}, InvalidRequestError, "--rates"),
        ({"slo_rate": -1.0}, InvalidRequestError, "--slo-rate"),
        ({"instances": 0}, InvalidRequestError, "--instances"),
    ],
)
def test_bad_sweep_settings_are_rejected(update: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SMALL.model_copy(update=update).check()
