"""Admission without HTTP: the pure decision, the pool's estimates (own work and the
instances' load reports), and the prefill stage (refuse before sending, never after)."""

from __future__ import annotations

import pytest

from flowprefill.contracts import SLOTableClass
from flowprefill.contracts.prefill_api import PrefillLoad, PrefillRequest, PrefillResponse
from flowprefill.gateway.admission import (
    Accept,
    Estimate,
    Refuse,
    decide,
    is_sheddable,
    predicted_finish_s,
)
from flowprefill.gateway.classify import Classification, Job
from flowprefill.gateway.errors import ShedError, UpstreamError
from flowprefill.gateway.metrics import GatewayMetrics
from flowprefill.gateway.openai_api import CompletionRequest
from flowprefill.gateway.prefill import PrefillStage
from flowprefill.gateway.routing import (
    Admitted,
    Instance,
    InstancePool,
    Placement,
    failover_call,
)
from flowprefill.gateway.upstream import PrefillAnswer, PrefillClient


def P(n: int) -> float:
    return n / 1000.0  # 1 ms per token


class Clock:
    def __init__(self, now_s: float = 100.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


# ----------------------------------------------------------------- the decision


def test_only_negative_priorities_are_sheddable() -> None:
    assert is_sheddable(-1) and not is_sheddable(0) and not is_sheddable(10)


def test_decide_accepts_refuses_or_routes_elsewhere() -> None:
    late, early = Estimate(0, 12.0), Estimate(1, 9.0)
    # The routed instance makes it: stays there.
    assert decide(sheddable=True, deadline_s=10.0, estimates=[early, late], preferred=1) == (
        Accept(1)
    )
    # The routed instance is late, another is not: rerouted.
    assert decide(sheddable=True, deadline_s=10.0, estimates=[late, early], preferred=0) == (
        Accept(1, rerouted=True)
    )
    # Nobody makes it: refused, retry once the best one's lateness has drained.
    refused = decide(sheddable=True, deadline_s=8.0, estimates=[late, early], preferred=0)
    assert refused == Refuse(retry_after_s=1.0, best_finish_s=9.0)
    assert decide(
        sheddable=True, deadline_s=8.0, estimates=[Estimate(0, 11.2)], preferred=0
    ) == Refuse(4.0, 11.2)
    # Never for lateness when not sheddable, however late.
    assert decide(sheddable=False, deadline_s=1.0, estimates=[late, early], preferred=0) == (
        Accept(0)
    )
    with pytest.raises(ValueError, match="preferred"):
        decide(sheddable=True, deadline_s=1.0, estimates=[late], preferred=1)


def test_predicted_finish_counts_the_work_ahead_as_one_prefill() -> None:
    assert predicted_finish_s(5.0, 300.0, 200, P) == pytest.approx(5.5)


# ------------------------------------------------------ the pool's estimates


def pool_of(n: int, clock: Clock, policy: str = "round-robin") -> InstancePool:
    return InstancePool(
        "prefill", [f"http://i{k}" for k in range(n)], policy=policy, predict_s=P, clock=clock
    )


def test_estimates_count_own_work_due_earlier_but_not_work_already_doomed() -> None:
    clock = Clock(100.0)
    pool = pool_of(1, clock)
    inst = pool.instances[0]
    pool.begin(inst, "due-earlier", 100.8, 500)  # feasible on its own: counted
    pool.begin(inst, "due-later", 103.0, 900)  # after the new request's deadline: not
    pool.begin(inst, "doomed", 100.2, 400)  # 0.4 s of work due in 0.2 s: S-EDF sinks it
    finish = pool.estimate_finish_s(inst, deadline_s=101.0, num_tokens=100, now_s=100.0)
    assert finish == pytest.approx(100.6)


def test_foreign_work_from_load_reports_counts_and_drains() -> None:
    clock = Clock(100.0)
    pool = pool_of(1, clock)
    inst = pool.instances[0]
    pool.begin(inst, "mine", 120.0, 300)
    pool.begin(inst, "answered", 120.0, 50)
    # The instance holds 1300 tokens beside the answered request: 300 are ours.
    pool.report_load(
        inst.url,
        PrefillLoad(backlog_tokens=1300, queue_delay_s=2.0, num_requests=5),
        answered="answered",
    )
    assert pool.reports[inst.url].foreign_tokens == 1000
    at = pool.estimate_finish_s(inst, deadline_s=150.0, num_tokens=0, now_s=100.0)
    assert at == pytest.approx(100.0 + 1.3 + 0.05)  # 300 + 50 own (still booked) + 1000
    half = pool.estimate_finish_s(inst, deadline_s=150.0, num_tokens=0, now_s=101.0)
    assert half == pytest.approx(101.0 + 0.35 + 0.5)  # half the foreign work drained
    gone = pool.estimate_finish_s(inst, deadline_s=150.0, num_tokens=0, now_s=103.0)
    assert gone == pytest.approx(103.0 + 0.35)
    pool.report_load(
        "http://unknown",
        PrefillLoad(backlog_tokens=1, queue_delay_s=1, num_requests=1),
        answered="x",
    )
    assert "http://unknown" not in pool.reports


def test_pool_admission_names_the_instance_the_request_goes_to() -> None:
    clock = Clock(100.0)
    pool = pool_of(2, clock)
    busy, idle = pool.instances
    for k in range(3):
        pool.begin(busy, f"b{k}", 100.9, 600)  # 1.8 s due before 101.0
    # Round-robin would send the first request to the busy instance: rerouted.
    work = Placement("r1", 101.0, 100)
    assert pool.admit(work, sheddable=True) == Admitted("r1", idle, rerouted=True)
    # A non-sheddable request keeps the routing choice (round-robin's next: idle; then
    # busy), late or not.
    assert pool.admit(Placement("r2", 101.0, 100), sheddable=False) == Admitted("r2", idle)
    assert pool.admit(Placement("r3", 101.0, 100), sheddable=False) == Admitted("r3", busy)
    pool.begin(idle, "i0", 100.96, 950)  # feasible itself, 1.05 s with ours
    assert isinstance(pool.admit(Placement("r4", 101.0, 100), sheddable=True), Refuse)


async def test_the_first_attempt_goes_where_admission_sent_it() -> None:
    """The admitted instance, not a new routing pick; a second pick if it is down."""
    clock = Clock(100.0)
    pool = pool_of(3, clock)
    client = Prefill()
    work = Placement("r1", 101.0, 100)
    admitted = Admitted("r1", pool.instances[2])

    async def call(inst: Instance) -> PrefillAnswer:
        return await client.prefill(
            inst.url,
            PrefillRequest(request_id="r1", prompt_token_ids=[1], ttft_slo_s=1.0, elapsed_s=0.0),
            {},
        )

    await failover_call(pool, work, call, admitted)
    pool.mark_failure(pool.instances[2])
    await failover_call(pool, work, call, admitted)
    assert client.sent == ["http://i2", "http://i0"]
    with pytest.raises(ValueError, match="admitted r1"):
        await failover_call(pool, Placement("r2", 101.0, 100), call, admitted)


# ------------------------------------------------------------ the prefill stage


def job(priority: int, *, arrival_s: float, slo_ms: int = 1000, rid: str = "cmpl-1") -> Job:
    slo = SLOTableClass(
        name="batch" if priority < 0 else "chat",
        task_type="file",
        ttft_slo_ms=slo_ms,
        priority=priority,
        attainment_target=0.9,
    )
    return Job(
        request_id=rid,
        kind="text_completion",
        body=CompletionRequest(model="m", prompt=[1] * 100, max_tokens=1),
        token_ids=[1] * 100,
        classification=Classification(slo, "default"),
        arrival_s=arrival_s,
    )


class Prefill(PrefillClient):
    """Answers at once, reporting ``backlog``; the first call to a URL in ``refuse`` is
    refused (after ``on_refuse`` ran: the load changing while a request is in flight)."""

    def __init__(self, backlog: int = 0, refuse: tuple[str, ...] = (), on_refuse=None) -> None:  # type: ignore[no-untyped-def]
        self.backlog, self.refuse, self.on_refuse = backlog, refuse, on_refuse
        self.sent: list[str] = []

    async def prefill(
        self, url: str, request: PrefillRequest, headers: dict[str, str]
    ) -> PrefillAnswer:
        self.sent.append(url)
        if url in self.refuse:
            if self.on_refuse is not None:
                self.on_refuse()
            raise UpstreamError(503, f"{url} refused", "prefill_unreachable", retryable=True)
        load = PrefillLoad(
            backlog_tokens=self.backlog, queue_delay_s=P(self.backlog), num_requests=1
        )
        response = PrefillResponse(
            request_id=request.request_id,
            first_token_id=7,
            num_prompt_tokens=len(request.prompt_token_ids),
            ttft_s=request.elapsed_s,
            met_slo=True,
            num_preemptions=0,
            batch_size=1,
            load=load,
        )
        return PrefillAnswer(response, request.elapsed_s, url)


async def test_stage_refuses_before_sending_and_counts_per_class() -> None:
    clock = Clock(100.0)
    pool = pool_of(2, clock, policy="slack-aware")
    for k, inst in enumerate(pool.instances):
        for j in range(2):
            pool.begin(inst, f"g{k}{j}", 100.9, 600)
    metrics = GatewayMetrics()
    client = Prefill()
    stage = PrefillStage(pool, client, metrics, clock, has_decode=False)
    with pytest.raises(ShedError) as refused:
        await stage.run(job(-1, arrival_s=100.0))
    err = refused.value
    assert (err.status, err.reason, err.slo_class) == (429, "shed", "batch")
    assert "'batch'" in str(err) and err.headers["retry-after"] == "1"
    assert client.sent == []  # nothing went upstream
    sample = metrics.registry.get_sample_value
    assert sample("flowprefill_gateway_shed_total", {"slo_class": "batch"}) == 1
    # The same load: a non-sheddable class is sent anyway.
    await stage.run(job(5, arrival_s=100.0, rid="cmpl-2"))
    assert len(client.sent) == 1
    assert sample("flowprefill_gateway_shed_total", {"slo_class": "chat"}) is None


async def test_stage_records_the_instances_load_report() -> None:
    clock = Clock(100.0)
    pool = pool_of(1, clock)
    stage = PrefillStage(pool, Prefill(backlog=4000), GatewayMetrics(), clock, has_decode=False)
    await stage.run(job(-1, arrival_s=100.0))
    assert pool.reports["http://i0"].foreign_tokens == 4000
    # 4 s of work nobody here sent: the next sheddable request (1 s SLO) is refused.
    with pytest.raises(ShedError):
        await stage.run(job(-1, arrival_s=100.0, rid="cmpl-2"))


async def test_a_request_once_accepted_is_never_refused_even_on_failover() -> None:
    clock = Clock(100.0)
    pool = pool_of(2, clock)

    def overload() -> None:  # while the first attempt is out, everything fills up
        for k, inst in enumerate(pool.instances):
            for j in range(3):
                pool.begin(inst, f"g{k}{j}", 100.9, 600)

    client = Prefill(refuse=("http://i0",), on_refuse=overload)
    stage = PrefillStage(pool, client, GatewayMetrics(), clock, has_decode=False)
    answer = await stage.run(job(-1, arrival_s=100.0))
    assert client.sent == ["http://i0", "http://i1"]
    assert answer.prefill_url == "http://i1"
    assert all("cmpl-1" not in inst.in_flight for inst in pool.instances)  # booked no more
