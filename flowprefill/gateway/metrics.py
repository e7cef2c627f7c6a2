"""Prometheus metrics of the gateway (the operator scrapes the SLO ones for SLOClass status)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flowprefill.metrics import TTFT_BUCKETS_S


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
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
            "Requests that produced a first token, by SLO class and whether it met the TTFT SLO.",
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
        self.in_flight = Gauge(
            "flowprefill_gateway_in_flight_requests", "Requests being served.", registry=r
        )
        self.errors = Counter(
            "flowprefill_gateway_errors",
            "Requests that ended in an error, by reason.",
            ["reason"],
            registry=r,
        )
        self.table_reloads = Counter(
            "flowprefill_gateway_slo_table_reloads", "SLO table reloads.", registry=r
        )
