"""What a gateway serves with: model, tokenizer, SLO table, instance pools, upstream
clients, metrics, clock. Built by :func:`flowprefill.gateway.cli.build_state`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flowprefill.contracts.gateway import HealthProbeSettings
from flowprefill.gateway.classify import SLOTableFile
from flowprefill.gateway.metrics import GatewayMetrics
from flowprefill.gateway.routing import InstancePool
from flowprefill.gateway.slo_targets import export_slo_targets
from flowprefill.gateway.tokenizer import Tokenizer
from flowprefill.gateway.upstream import DecodeClient, PrefillClient


@dataclass
class GatewayState:
    model_name: str
    tokenizer: Tokenizer
    slo_file: SLOTableFile
    prefill_pool: InstancePool
    decode_pool: InstancePool | None
    prefill_client: PrefillClient
    decode_client: DecodeClient | None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    clock: Callable[[], float] = time.monotonic
    """Monotonic seconds: arrival, deadlines, TTFT."""
    table_refresh_s: float = 1.0
    """How often the SLO table file is checked for changes."""
    health_probe: HealthProbeSettings | None = field(default_factory=HealthProbeSettings)
    """Liveness probing of the instances (flowprefill.gateway.health); None: off."""

    def __post_init__(self) -> None:
        export_slo_targets(self.metrics.registry, lambda: self.slo_file.table)
