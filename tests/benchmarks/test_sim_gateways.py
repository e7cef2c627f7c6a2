"""benchmarks/sim/gateways.py at its smallest size, and the replicas' contract: one
replica is the single gateway, exactly; replicas split the requests and each books only
its own."""

from __future__ import annotations

from pathlib import Path

from flowprefill.lab.sim.config import SweepConfig, WorkloadSpec
from flowprefill.lab.sim.gateways import Replicas, run_replicated
from flowprefill.lab.sim.sweep import evaluator
from flowprefill.lab.sim.systems import get_system, run_system
from tests.benchmarks.smoke import run_script


def test_the_benchmark_prints_its_table(tmp_path: Path) -> None:
    out = run_script(
        "sim/gateways.py", "--num-requests", "30", "--jobs", "1", "--instances", "2",
        "--routers", "slack-aware", "--loads", "1.0", "--gateways", "1", "2",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert "2 gw attainment" in out and "slack-aware" in out


def test_one_replica_is_the_single_gateway() -> None:
    cfg = SweepConfig(workload=WorkloadSpec(num_requests=80, seeds=(0,)), instances=3)
    ev = evaluator(cfg)
    spec = get_system("flowprefill")
    w = ev.workloads[0]
    rate = ev.bound_rps()
    predictor = ev.predictor_for(spec)
    one = run_replicated(
        spec, w, ev.cost, rate=rate, predictor=predictor, gateways=1, num_instances=3,
        router="slack-aware",
    )  # fmt: skip
    single = run_system(
        spec, w, ev.cost, rate=rate, predictor=predictor, num_instances=3, router="slack-aware"
    )
    assert one.ttft_s == single.ttft_s


def test_replicas_split_round_robin_and_route_with_their_own_books() -> None:
    from flowprefill.lab.sim.driver import Simulation
    from flowprefill.lab.sim.systems import build_instance, cached_predict

    cfg = SweepConfig(workload=WorkloadSpec(num_requests=40, seeds=(0,)), instances=2)
    ev = evaluator(cfg)
    spec = get_system("flowprefill")
    predict_s = cached_predict(ev.predictor_for(spec))
    replicas = Replicas("least-loaded", 2)
    seen: list[list[str]] = [[], []]
    for k, replica in enumerate(replicas.replicas):
        choose = replica.choose

        def record(request, instances, now_s, choose=choose, k=k, me=replica):  # type: ignore[no-untyped-def]
            seen[k].append(request.request_id)
            # What this replica has in flight is only ever what it sent.
            for _, book in me._books.values():
                assert set(book.in_flight) <= set(seen[k])
            return choose(request, instances, now_s)

        replica.choose = record  # type: ignore[method-assign]
    instances = [build_instance(spec, ev.cost, predict_s) for _ in range(2)]
    requests = list(ev.workloads[0].requests(2 * ev.bound_rps(), 1.0))
    Simulation(instances, router=replicas).run(requests)
    ids = [r.request_id for r in requests]
    assert seen == [ids[0::2], ids[1::2]]
