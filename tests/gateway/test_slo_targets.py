"""The attainment-target gauge follows the SLO table the gateway serves."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flowprefill.contracts.metrics import GATEWAY_SLO_ATTAINMENT_TARGET
from flowprefill.contracts.slo import SLOTable, SLOTableClass
from flowprefill.gateway.metrics import GatewayMetrics, export_slo_targets


def _table(**targets: float) -> SLOTable:
    classes = [
        SLOTableClass(name=n, task_type="text", ttft_slo_ms=250, priority=0, attainment_target=t)
        for n, t in targets.items()
    ]
    return SLOTable(default_class=None, classes=classes)


def _targets(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {
        s.labels["slo_class"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == GATEWAY_SLO_ATTAINMENT_TARGET
        for s in f.samples
    }


def test_targets_are_read_from_the_current_table_at_every_scrape() -> None:
    current = {"table": _table(chat=0.99, batch=0.9)}
    metrics = GatewayMetrics()
    export_slo_targets(metrics.registry, lambda: current["table"])
    assert _targets(metrics.registry) == {"chat": 0.99, "batch": 0.9}
    current["table"] = _table(chat=0.95)  # a reload: changed target, a class removed
    assert _targets(metrics.registry) == {"chat": 0.95}
    # The gateway's own metrics still come from the same registry.
    assert "flowprefill_gateway_slo_requests_total" in generate_latest(metrics.registry).decode()
