"""Files the operator writes into ConfigMaps for the engine and the gateway.

The formats belong to the processes that read them, so they are defined once, in
:mod:`flowprefill.contracts`: ``engine.json`` is
:class:`flowprefill.contracts.engine.EngineConfig` (read by ``flowprefill serve-prefill``);
``gateway.json`` and ``slo-table.json`` are read by ``flowprefill serve-gateway``, which
reloads the SLO table when the file changes. Documented in docs/operator.md.
"""

from __future__ import annotations

from flowprefill.contracts import (
    Endpoint,
    EngineConfig,
    GatewayConfig,
    SLOTable,
    SLOTableClass,
    SLOTableMatch,
)

__all__ = [
    "Endpoint",
    "EngineConfig",
    "GatewayConfig",
    "SLOTable",
    "SLOTableClass",
    "SLOTableMatch",
]
