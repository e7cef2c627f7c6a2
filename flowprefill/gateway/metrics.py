"""Prometheus metrics of the gateway (the operator scrapes the SLO ones for SLOClass status).

Also ``flowprefill_gateway_slo_attainment_target{slo_class}`` (:func:`export_slo_targets`):
each class's attainment target from the SLO table it serves, read when scraped, so a
reloaded table shows at once and a removed class disappears. With the SLO counters it lets
a recording rule compute the error-budget burn rate, missed / (1 - target)
(charts/flowprefill/files/recording-rules.yaml).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from flowprefill.contracts.metrics import (
    CLAIM_LABEL,
    GATEWAY_CLAIMS_REFUSED,
    GATEWAY_OVERLOAD_REFUSED,
    GATEWAY_PREFILL_WORK,
    GATEWAY_SHED,
    GATEWAY_SLO_ATTAINMENT_TARGET,
    GATEWAY_TPOT,
    GATEWAY_WAITING,
    GATEWAY_WAITING_MAX,
    OVERLOAD_REASON_LABEL,
    SLO_CLASS_LABEL,
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
)
from flowprefill.contracts.slo import SLOTable
from flowprefill.gateway.classify import Refusal
from flowprefill.gateway.errors import GatewayError

M = TypeVar("M", Counter, Gauge, Histogram)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], object] = {}
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "flowprefill_gateway_ttft_seconds",
            "Arrival at the gateway to the first token sent to the client, by SLO class.",
            ["slo_class"],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.slo_requests = Counter(
            "flowprefill_gateway_slo_requests",
            "Requests by SLO class and whether they met the TTFT SLO: counted at the first "
            "token, or as missed at the deadline when still waiting then (not again later).",
            ["slo_class", "outcome"],
            registry=r,
        )
        self.queue_time = Histogram(
            "flowprefill_gateway_prefill_wait_seconds",
            "Time a request spent at its prefill instance (queue and prefill), by SLO class.",
            ["slo_class"],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            GATEWAY_TPOT,
            "Time per output token after the first, of requests decode continued, by SLO class.",
            ["slo_class"],
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "flowprefill_gateway_in_flight_requests", "Requests being served.", registry=r
        )
        self.errors = Counter(
            "flowprefill_gateway_errors",
            "Requests that ended in an error, by reason.",
            ["reason"],
            registry=r,
        )
        self.prefill_work = Counter(
            GATEWAY_PREFILL_WORK,
            "Predicted device-seconds of the prefills served, by SLO class (the TTFT "
            "profile's time per prompt): its rate is the prefill load in replicas' worth.",
            [SLO_CLASS_LABEL],
            registry=r,
        )
        self.shed = Counter(
            GATEWAY_SHED,
            "Requests of a sheddable SLO class refused at arrival (429): no prefill instance "
            "was predicted to produce their first token before the deadline.",
            [SLO_CLASS_LABEL],
            registry=r,
        )
        self.overload_refused = Counter(
            GATEWAY_OVERLOAD_REFUSED,
            "Requests answered 503 with Retry-After under overload, by SLO class and reason: "
            "too_late (predicted past deadline + useful wait), expired (still waiting "
            "then), queue_full (the gateway's most waiting requests reached).",
            [SLO_CLASS_LABEL, OVERLOAD_REASON_LABEL],
            registry=r,
        )
        self.waiting = Gauge(
            GATEWAY_WAITING, "Requests admitted and waiting for their first token.", registry=r
        )
        self.waiting_max = Gauge(
            GATEWAY_WAITING_MAX,
            "The most requests waiting for their first token at once since start.",
            registry=r,
        )
        self.table_reloads = Counter(
            "flowprefill_gateway_slo_table_reloads", "SLO table reloads.", registry=r
        )
        self.claims_refused = Counter(
            GATEWAY_CLAIMS_REFUSED,
            "Requests whose claim (a class by name, a priority, a tighter TTFT target) the "
            "class's claim rule did not admit, by the class claimed.",
            [SLO_CLASS_LABEL, CLAIM_LABEL],
            registry=r,
        )

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, looked up once: the per-request counters cost a lock
        and a tuple per call in prometheus_client. (Children are never removed here, and
        prometheus_client keeps every child it made anyway.)"""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found  # type: ignore[return-value]

    def first_token(
        self, slo_class: str, *, ttft_s: float, met: bool, wait_s: float, counted: bool = False
    ) -> None:
        """A request's first token went to its client ``ttft_s`` after gateway arrival;
        ``met`` is judged against the request's TTFT target; ``wait_s`` was spent at
        prefill; ``counted``: already counted missed at its deadline."""
        self.child(self.ttft, slo_class).observe(ttft_s)
        if not counted:
            self.child(self.slo_requests, slo_class, "met" if met else "missed").inc()
        self.child(self.queue_time, slo_class).observe(wait_s)

    def missed_at_deadline(self, slo_class: str) -> None:
        """A request had no first token by its deadline: missed, counted now (and not
        again at its first token), so that the miss shows while it still waits."""
        self.child(self.slo_requests, slo_class, "missed").inc()

    def decoded(self, slo_class: str, *, decode_s: float, num_tokens: int) -> None:
        """``num_tokens`` (the first included) reached the client, the last ``decode_s``
        after the first: one TPOT sample, unless decode added no token."""
        if num_tokens > 1:
            self.child(self.tpot, slo_class).observe(decode_s / (num_tokens - 1))

    def claims(self, refusals: Iterable[Refusal]) -> None:
        """Count the refused claims of one request (unknown class names are not claims)."""
        for r in refusals:
            if r.claim is not None and r.slo_class is not None:
                self.claims_refused.labels(r.slo_class, r.claim).inc()

    def failed(self, err: GatewayError) -> None:
        self.child(self.errors, err.reason).inc()


HELP = "Target fraction of requests meeting the TTFT SLO (attainmentTarget), by SLO class."


class SLOTargets(Collector):
    def __init__(self, table: Callable[[], SLOTable]) -> None:
        self.table = table

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(GATEWAY_SLO_ATTAINMENT_TARGET, HELP, labels=[SLO_CLASS_LABEL])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(GATEWAY_SLO_ATTAINMENT_TARGET, HELP, labels=[SLO_CLASS_LABEL])
        for slo_class in self.table().classes:
            family.add_metric([slo_class.name], slo_class.attainment_target)
        yield family


def export_slo_targets(registry: CollectorRegistry, table: Callable[[], SLOTable]) -> None:
    """Serve the targets of ``table()`` (called at every scrape) from ``registry``."""
    registry.register(SLOTargets(table))
