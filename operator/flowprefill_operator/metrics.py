"""The operator's own Prometheus metrics (the autoscaler's decisions), served on
``metricsPort`` (``FLOWPREFILL_OPERATOR_METRICS_PORT``; 0 = not served)."""

from __future__ import annotations

import contextlib
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from flowprefill.contracts.metrics import (
    DIRECTION_LABEL,
    NAMESPACE_LABEL,
    OPERATOR_AUTOSCALER_DECISIONS,
    OPERATOR_AUTOSCALER_DESIRED_REPLICAS,
    POOL_LABEL,
)

log = logging.getLogger(__name__)


class OperatorMetrics:
    """One registry per operator process (kept in kopf's memo)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.desired_replicas = Gauge(
            OPERATOR_AUTOSCALER_DESIRED_REPLICAS,
            "Replicas the autoscaler last decided on, by pool (replicasOwner operator).",
            [NAMESPACE_LABEL, POOL_LABEL],
            registry=self.registry,
        )
        self.decisions = Counter(
            OPERATOR_AUTOSCALER_DECISIONS,
            "Replica changes the autoscaler wrote through a pool's /scale, by direction.",
            [NAMESPACE_LABEL, POOL_LABEL, DIRECTION_LABEL],
            registry=self.registry,
        )

    def decided(self, namespace: str, pool: str, replicas: int) -> None:
        self.desired_replicas.labels(namespace, pool).set(replicas)

    def scaled(self, namespace: str, pool: str, before: int, after: int) -> None:
        if after != before:
            self.decisions.labels(namespace, pool, "up" if after > before else "down").inc()

    def forget(self, namespace: str, pool: str) -> None:
        """The pool left the autoscaler (deleted, or its replicas owned elsewhere now)."""
        with contextlib.suppress(KeyError):  # it had no gauge
            self.desired_replicas.remove(namespace, pool)

    def serve(self, port: int) -> None:
        """Serve /metrics on ``port`` in a daemon thread (0: do not)."""
        if port:
            try:
                start_http_server(port, registry=self.registry)
            except OSError as e:
                raise RuntimeError(f"cannot serve the operator's metrics on :{port}: {e}") from e
            log.info("operator metrics on :%d/metrics", port)
