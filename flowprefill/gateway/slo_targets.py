"""The gateway's ``flowprefill_gateway_slo_attainment_target{slo_class}`` gauge: each
class's attainment target from the SLO table it serves, read when scraped, so a reloaded
table shows at once and a removed class disappears. With the SLO counters it lets a
recording rule compute the error-budget burn rate, missed / (1 - target)
(charts/flowprefill/files/recording-rules.yaml)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from flowprefill.contracts.metrics import GATEWAY_SLO_ATTAINMENT_TARGET, SLO_CLASS_LABEL
from flowprefill.contracts.slo import SLOTable

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
